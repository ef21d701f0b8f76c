"""MintClient calls beyond the basics, on every client (HTTP, local store, S3 store): bases,
name listing with prefix and cursor; and SyncMintClient.follow over the service."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from engine_client import MintClient, SyncMintClient
from engine_client.errors import BaseMismatch, BaseNotFound, Conflict
from tests.support.factories import random_adapter
from tests.support.service import ServerFactory, until_parked
from tests.support.targets import StoreTarget

from .test_client import client  # noqa: F401 -- the client fixture over all three clients

SHAPES = {f"model.layers.{i}.self_attn.{m}": [32, 32] for i in range(2) for m in ("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj")}


async def test_register_base_then_publish_against_it(client: MintClient) -> None:  # noqa: F811
    with pytest.raises(BaseNotFound):
        await client.base("tiny")
    await client.register_base("tiny", SHAPES)
    await client.register_base("tiny", SHAPES)  # the same shapes again: a no-op
    assert await client.base("tiny") == SHAPES
    with pytest.raises(Conflict):  # a base's shapes never change
        await client.register_base("tiny", {**SHAPES, "model.layers.0.self_attn.q_proj": [32, 33]})
    assert await client.base("tiny") == SHAPES
    fits = random_adapter(1, base="tiny")
    assert (await client.publish("acme", "ok", fits)).version == 1
    with pytest.raises(BaseMismatch):
        await client.publish("acme", "wide", random_adapter(2, hidden=48, base="tiny"))
    assert await client.names("acme") == ["ok"]


async def test_names_with_prefix_and_after(client: MintClient) -> None:  # noqa: F811
    names = ["app", "chat-a", "chat-b", "chat-c", "code"]
    for i, name in enumerate(names):
        await client.publish("acme", name, random_adapter(i))
    await client.publish("beta", "chat-z", random_adapter(9))
    assert await client.names("acme") == names
    assert await client.names("acme", prefix="chat-") == ["chat-a", "chat-b", "chat-c"]
    assert await client.names("acme", prefix="chat-", after="chat-a") == ["chat-b", "chat-c"]
    assert await client.names("acme", prefix="chat-", after="chat-a", limit=1) == ["chat-b"]
    assert await client.names("acme", after="chat-c") == ["code"]
    assert await client.names("acme", prefix="zzz") == []
    assert await client.names("beta") == ["chat-z"]


async def test_sync_client_follow_yields_commits_as_they_happen(make_server: ServerFactory,
                                                                local_target: StoreTarget, peft_dir: Path) -> None:
    server = await make_server(local_target)
    seen: list[dict[str, Any]] = []
    failed: list[BaseException] = []

    def follow() -> None:  # a blocking consumer in its own thread, as a script would be
        try:
            with SyncMintClient(server.url) as c:
                for event in c.follow(0, wait=10):
                    seen.append(event)
                    if len(seen) == 2:
                        return  # leaving the loop closes the generator and its poll
        except BaseException as e:  # reported below
            failed.append(e)

    thread = threading.Thread(target=follow)
    thread.start()
    try:
        await until_parked(server)  # its long poll is asleep in the feed before anything is committed
        async with MintClient(server.url) as writer:
            await writer.publish("acme", "chat", peft_dir, tag="prod")
            await writer.tag("acme/chat@1", "canary")
    finally:
        await asyncio.to_thread(thread.join, 60)
    assert failed == [] and not thread.is_alive()
    assert [(e["seq"], e["kind"]) for e in seen] == [(1, "publish"), (2, "tag")]
    assert seen[1]["tag"] == "canary"
