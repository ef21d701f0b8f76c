"""The client's shape after the split: one factory, blocking twins generated from the async methods."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from engine_client import MintClient, SyncMintClient
from engine_client.client.base import client_class
from engine_client.client.http_transport import HttpMintClient
from engine_client.client.local_transport import StoreMintClient
from mint_store.read.buffers import row_buffer


def test_the_factory_picks_the_transport_by_url(tmp_path):
    assert client_class("http://127.0.0.1:1") is HttpMintClient
    assert client_class("https://mint.example") is HttpMintClient
    assert client_class(tmp_path) is StoreMintClient
    assert client_class("s3://bucket/prefix") is StoreMintClient
    assert type(MintClient("http://127.0.0.1:1")) is HttpMintClient
    local = MintClient(tmp_path / "store")
    assert type(local) is StoreMintClient and isinstance(local, MintClient)
    assert type(HttpMintClient("http://127.0.0.1:1")) is HttpMintClient  # a subclass builds itself


def test_every_public_coroutine_has_a_blocking_twin():
    skip = {"close", "follow"}  # close() ends the loop too; follow() is a generator
    asyncs = {n for n, f in inspect.getmembers(MintClient, inspect.iscoroutinefunction) if not n.startswith("_")}
    assert asyncs - skip
    for name in asyncs - skip:
        twin = getattr(SyncMintClient, name)
        assert not inspect.iscoroutinefunction(twin), name
        assert twin.__doc__ == getattr(MintClient, name).__doc__, name
        assert inspect.signature(twin) == inspect.signature(getattr(MintClient, name)), name


def test_blocking_twins_run_on_the_store(tmp_path):
    with SyncMintClient(tmp_path / "store") as c:
        assert c.tenants() == []
        assert c.bases() == {}
        with pytest.raises(Exception) as info:
            c.resolve("acme/none")
        assert type(info.value).__name__ == "AdapterNotFound"


def test_row_buffer_checks_once_for_store_and_clients():
    out, view = row_buffer(8)
    assert out.dtype == np.uint8 and len(view) == 8
    big = np.zeros(4, dtype=np.float32)  # 16 bytes, viewed as bytes
    assert row_buffer(8, big)[1].nbytes == 8
    with pytest.raises(ValueError, match="smaller than the row"):
        row_buffer(32, big)
    ro = np.zeros(8, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        row_buffer(8, ro)


def test_a_blocking_client_refused_for_its_options_leaves_no_thread_running() -> None:
    import threading

    before = sum(t.name == "mint-client" for t in threading.enumerate())
    for _ in range(3):
        with pytest.raises(ValueError, match="retries"):
            SyncMintClient("http://127.0.0.1:9", retries=-1)
    assert sum(t.name == "mint-client" for t in threading.enumerate()) == before


async def test_a_local_client_is_woken_by_its_own_commits_once_the_writer_it_shared_is_closed(tmp_path) -> None:
    """Client b first wrote through a's store (one writer per process); a closed, b's next write
    opened its own writer, but b still listened to a's closed store: its long polls slept their
    whole wait instead of waking at b's commits."""
    from tests.support.factories import random_adapter

    url = str(tmp_path / "store")
    a, b = MintClient(url), MintClient(url)
    await a.publish("acme", "x", random_adapter(1))
    await b.publish("acme", "x", random_adapter(2))  # through a's writer
    await a.close()
    await b.publish("acme", "x", random_adapter(3))  # b's own writer now
    b._commits.clear()
    await b.publish("acme", "x", random_adapter(4))
    assert b._commits.is_set()  # commit listeners run before the publish is answered
    head = (await b.events(0, limit=0)).head
    assert [e["seq"] for e in (await b.events(head - 1, wait=0)).events] == [head]
    await b.close()
