"""A tenant token learns only its own sequence information and its own layouts.

The store's seq counts every tenant's commits: in a publish answer, or as the seqs of a
tenant's events (the gaps between them), it told a tenant how busy the others are. A tenant
is answered in its own numbering (its n-th visible event is seq n), the same on every server
of the store. ``GET /v1/layouts/{id}`` confirmed that some tenant stores a rank and target set;
a replica's public ``/healthz`` gave its checkpoint seq and raw errors to anyone. Real servers
on loopback with two tenant tokens and an admin token.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp

from engine_client import MintClient
from tests.support.service import TOKENS, ServerFactory, auth, publish, read_peft
from tests.support.targets import StoreTarget

LIVENESS = 60.0  # a bound on a hang, never a measure of speed


async def _events(http: aiohttp.ClientSession, url: str, who: str, **params: Any) -> dict[str, Any]:
    async with http.get(f"{url}/v1/events", params={k: str(v) for k, v in params.items()}, headers=auth(who)) as r:
        assert r.status == 200
        return dict(await r.json())


async def _mixed_history(http: aiohttp.ClientSession, server: Any, files: dict[str, bytes]) -> list[dict[str, Any]]:
    """acme publishes (store seq 1), beta publishes three times and tags (2..5), acme again (6),
    an admin for acme (7). Returns the publish answers in that order."""
    out = [await publish(http, server, files, "acme", "a", headers=auth("acme"))]
    out += [await publish(http, server, files, "beta", f"b{i}", headers=auth("beta")) for i in range(3)]
    async with http.put(f"{server.url}/v1/adapters/beta/b0/tags/prod", json={"version": 1},
                        headers=auth("beta")) as r:
        assert r.status == 200
    out.append(await publish(http, server, files, "acme", "a", headers=auth("acme")))
    out.append(await publish(http, server, files, "acme", "c", headers=auth("admin")))
    return out


async def test_a_publish_answer_counts_only_the_tenants_own_commits(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, peft_files: dict[str, bytes],
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    async with aiohttp.ClientSession() as http:
        acme1, beta1, beta2, beta3, acme2, admin = await _mixed_history(http, server, peft_files)
    # the store's seqs were 1 and 6 for acme, 2..4 for beta
    assert (acme1["seq"], acme2["seq"]) == (1, 2) and (beta1["seq"], beta2["seq"], beta3["seq"]) == (1, 2, 3)
    assert admin["seq"] == 7  # an admin keeps the store's seq


async def test_a_tenants_events_are_numbered_in_its_own_count_on_every_server(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, tmp_path: Path,
    peft_files: dict[str, bytes],
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    async with aiohttp.ClientSession() as http:
        await _mixed_history(http, server, peft_files)
        feed = await _events(http, server.url, "acme", after=0)
        # acme's events were the store's seqs 1, 6, 7: the gaps told it beta's commit count
        assert [(e["seq"], e["items"][0]["version"]) for e in feed["events"]] == [(1, 1), (2, 2), (3, 1)]
        assert (feed["last_seq"], feed["head"]) == (3, 3)
        feed = await _events(http, server.url, "beta", after=2)
        assert [(e["seq"], e["kind"]) for e in feed["events"]] == [(3, "publish"), (4, "tag")]
        assert (feed["last_seq"], feed["head"]) == (4, 4)
        assert (await _events(http, server.url, "acme-read", after=0, limit=0))["head"] == 3
        assert [e["seq"] for e in (await _events(http, server.url, "admin", after=5))["events"]] == [6, 7]
        # a long poll after acme's head: beta's commit wakes it and shows nothing; acme's ends it
        poll = asyncio.create_task(_events(http, server.url, "acme", after=3, wait=LIVENESS))
        await publish(http, server, peft_files, "beta", "b9", headers=auth("beta"))
        await publish(http, server, peft_files, "acme", "d", headers=auth("acme"))
        got = await asyncio.wait_for(poll, LIVENESS)
        assert [e["seq"] for e in got["events"]] == [4] and (got["last_seq"], got["head"]) == (4, 4)
        # another server of the store (a replica, its own index) numbers alike: a cursor survives failover
        replica = await make_server(dataclasses.replace(local_target, index_dir=str(tmp_path / "replica-index")),
                                    readonly=True, tokens_file=tokens_file)
        async with asyncio.timeout(LIVENESS):
            while (await _events(http, replica.url, "admin", after=0, limit=0))["head"] < 9:
                await asyncio.sleep(0.02)
        for who in ("acme", "beta"):
            assert await _events(http, replica.url, who, after=0) == await _events(http, server.url, who, after=0)


async def test_the_engine_client_follows_a_tenants_feed_in_its_own_numbering(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, peft_dir: Path,
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    files = read_peft(peft_dir)
    async with aiohttp.ClientSession() as http, MintClient(server.url, token=TOKENS["acme"]) as client:
        await publish(http, server, files, "acme", "a", headers=auth("acme"))
        for i in range(4):
            await publish(http, server, files, "beta", f"b{i}", headers=auth("beta"))
        head = (await client.events(0, limit=0)).head
        assert head == 1
        seen: list[dict[str, Any]] = []

        async def follow() -> None:
            async for event in client.follow(head, wait=LIVENESS):
                seen.append(event)
                if len(seen) == 2:
                    return

        task = asyncio.create_task(follow())
        await publish(http, server, files, "beta", "b9", headers=auth("beta"))
        result = await client.publish("acme", "a", peft_dir)
        await client.tag("acme/a@1", "prod")
        await asyncio.wait_for(task, LIVENESS)
    assert result.seq == 2 and [(e["seq"], e["kind"]) for e in seen] == [(2, "publish"), (3, "tag")]


async def test_a_tenant_reads_only_layouts_it_stores(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, peft_dir: Path, peft_dir2: Path,
) -> None:
    server = await make_server(local_target, tokens_file=tokens_file)
    async with aiohttp.ClientSession() as http:
        mine = await publish(http, server, read_peft(peft_dir), "acme", "a", headers=auth("acme"))
        theirs = await publish(http, server, read_peft(peft_dir2), "beta", "b", headers=auth("beta"))
        assert mine["layout_id"] != theirs["layout_id"]

        async def layout(layout_id: str, who: str) -> tuple[int, dict[str, Any]]:
            async with http.get(f"{server.url}/v1/layouts/{layout_id}", headers=auth(who)) as r:
                return r.status, dict(await r.json())

        assert (await layout(mine["layout_id"], "acme"))[0] == 200
        assert (await layout(theirs["layout_id"], "beta"))[0] == 200
        status, hidden = await layout(theirs["layout_id"], "acme")
        _, unknown = await layout("f" * 32, "acme")
        assert status == 404 and hidden["error"] == unknown["error"] == "layout_not_found"
        assert hidden["message"].replace(theirs["layout_id"], "f" * 32) == unknown["message"]
        assert (await layout(theirs["layout_id"], "admin"))[0] == 200
        # once acme holds the same rank and modules itself, it may read that layout
        same = await publish(http, server, read_peft(peft_dir2), "acme", "c", headers=auth("acme"))
        assert same["layout_id"] == theirs["layout_id"] and (await layout(theirs["layout_id"], "acme"))[0] == 200
        # and not after it deleted its last live version of it
        async with http.delete(f"{server.url}/v1/adapters/acme/c/versions/1", headers=auth("acme")) as r:
            assert r.status == 200
        assert (await layout(theirs["layout_id"], "acme"))[0] == 404


async def test_a_replicas_public_healthz_shows_no_checkpoint_seq_and_no_errors(
    make_server: ServerFactory, local_target: StoreTarget, tokens_file: str, tmp_path: Path,
    peft_files: dict[str, bytes],
) -> None:
    writer = await make_server(local_target, tokens_file=tokens_file)
    replica = await make_server(dataclasses.replace(local_target, index_dir=str(tmp_path / "replica-index")),
                                readonly=True, tokens_file=tokens_file)
    async with aiohttp.ClientSession() as http:
        await publish(http, writer, peft_files, "acme", "a", headers=auth("acme"))
        for headers in ({}, auth("acme"), auth("beta"), {"Authorization": "Bearer not-a-token-at-all"}):
            async with http.get(f"{replica.url}/healthz", headers=headers) as r:
                body = await r.json()
                assert r.status == 200 and body["writable"] is False, body
                assert "replica" not in body and "last_seq" not in body, body
        async with http.get(f"{replica.url}/healthz", headers=auth("admin")) as r:
            body = await r.json()
        assert {"checkpoint_seq", "last_poll", "last_error", "reloads"} <= set(body["replica"]) and "last_seq" in body
