"""`mint serve --replica` (issue 14): a read-only service on its own index follows the writer,
and a write sent to it is answered 405 ``not_the_writer`` naming the writer's URL."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp
import pytest

from engine_client import MintClient
from mint_store.cli.commands import build_parser
from mint_store.errors import NotTheWriter
from tests.support.service import ServerFactory, peft_form, publish, read_peft
from tests.support.targets import StoreTarget


async def test_a_write_to_a_replica_names_the_writer_over_http(
    make_server: ServerFactory, target: StoreTarget, tmp_path: Path, peft_dir: Path
) -> None:
    files = read_peft(peft_dir)
    writer = await make_server(target)
    # another machine: its own index directory, built from the store itself
    replica = await make_server(dataclasses.replace(target, index_dir=str(tmp_path / "replica-index")),
                                readonly=True)
    async with aiohttp.ClientSession() as http:
        first = await publish(http, writer, files)
        async with http.put(f"{replica.url}/v1/adapters/acme/chat?tag=prod", data=peft_form(files)) as r:
            body = await r.json()
            assert r.status == 405, body
            assert body["error"] == "not_the_writer"
            assert body["writer_url"] == writer.url
            assert r.headers["Location"] == f"{writer.url}/v1/adapters/acme/chat?tag=prod"
        # the replica follows: the writer's publish becomes readable there
        for _ in range(6000):
            async with http.get(f"{replica.url}/v1/adapters/acme/chat/versions/{first['version']}") as r:
                if r.status == 200:
                    assert (await r.json())["content_id"] == first["content_id"]
                    break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the replica never saw the writer's publish")
        async with http.get(f"{replica.url}/healthz") as r:
            health = await r.json()
            assert r.status == 200 and health["writable"] is False
            assert health["replica"]["last_error"] is None and health["replica"]["last_poll"] is not None
    async with MintClient(replica.url, retries=0) as client:  # the typed error survives HTTP
        with pytest.raises(NotTheWriter) as err:
            await client.tag("acme/chat@1", "prod")
        assert err.value.writer_url == writer.url


def test_serve_takes_replica() -> None:
    assert build_parser().parse_args(["serve", "--replica"]).replica is True
    assert build_parser().parse_args(["serve"]).replica is False
