"""A storage fault seen over HTTP: the failed publish is a 503 with a typed code, /healthz says
degraded (503) while the storage refuses writes and ok once the writer has recovered."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mint_store.peft.directory import load_peft_dir, load_peft_files
from mint_store.storage.retry import RetryPolicy
from tests.support.service import ServerFactory, expect_error, peft_form, publish, read_peft, store_of
from tests.support.targets import StoreTarget


async def health(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(f"{url}/healthz") as r:
        return r.status, await r.json()


async def test_healthz_is_degraded_while_writes_fail_and_ok_after_recovery(
    make_server: ServerFactory, local_target: StoreTarget, http: aiohttp.ClientSession, peft_dir: Path,
    peft_dir2: Path,
) -> None:
    server = await make_server(local_target, store_options={"retry": RetryPolicy(attempts=2, base_s=0.01, max_s=0.05)})
    store = store_of(server)
    first = await publish(http, server, read_peft(peft_dir))
    assert await health(http, server.url) == (200, {"status": "ok", "last_seq": 1, "writable": True})

    storage = store.storage

    def full_disk(key: str, data: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), key)

    patch = pytest.MonkeyPatch()
    for write in ("put", "put_if_absent"):  # the disk fills up: no write of any kind lands
        patch.setattr(storage, write, full_disk)
    try:
        async with http.put(f"{server.url}/v1/adapters/acme/other", data=peft_form(read_peft(peft_dir2))) as r:
            body = await expect_error(r, 503, "store_unavailable")
        assert "No space left" in body["message"]
        status, doc = await health(http, server.url)
        assert status == 503 and doc["status"] == "degraded" and doc["writable"] is False
        assert "No space left" in doc["reason"]
        async with http.put(f"{server.url}/v1/adapters/acme/other", data=peft_form(read_peft(peft_dir2))) as r:
            await expect_error(r, 503, "store_unavailable")  # refused at once while degraded
        async with http.get(f"{server.url}/v1/adapters/acme/chat/versions/1/content") as r:
            assert r.status == 200  # reads go on
    finally:
        patch.undo()  # space is freed
    writer = store._writer
    assert writer is not None
    assert await asyncio.get_running_loop().run_in_executor(None, writer.health.wait_writable, 60)
    assert await health(http, server.url) == (200, {"status": "ok", "last_seq": 1, "writable": True})

    second = await publish(http, server, read_peft(peft_dir2), name="other")
    assert second["version"] == 1 and second["seq"] == 2
    for name, d, got in (("chat", peft_dir, first), ("other", peft_dir2, second)):
        async with http.get(f"{server.url}/v1/adapters/acme/{name}/versions/1/peft") as r:
            assert r.status == 200
            data = await r.read()
        import io
        import tarfile

        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            config, weights = (tar.extractfile(n).read() for n in ("adapter_config.json",  # type: ignore[union-attr]
                                                                    "adapter_model.safetensors"))
        assert load_peft_files(config, weights).content_id() == got["content_id"] == load_peft_dir(d).content_id()
