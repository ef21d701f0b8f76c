"""A standby server in this process beside a writer server (two index directories, one store):
what it answers while it waits, and its take-over when the writer closes."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_client import SyncMintClient
from mint_store.errors import NotTheWriter, ReadOnlyStore
from mint_store.service import ServiceConfig
from mint_store.service.app import ServerThread
from mint_store.storage import open_storage
from mint_store.write.lease import LEASE_KEY
from tests.support.factories import random_adapter

DEADLINE_S = 60.0  # a bound for waits, never a pass/fail threshold
LEASE = {"lease_ttl_s": 2.0, "lease_renew_s": 0.3}


def _wait_for(probe: Callable[[], Any], what: str) -> Any:
    stop = time.monotonic() + DEADLINE_S
    while (got := probe()) in (None, False):
        if time.monotonic() > stop:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)
    return got


def _health(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=DEADLINE_S) as r:
            return dict(json.load(r))
    except urllib.error.HTTPError as e:
        return dict(json.loads(e.read()))


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def start(index: str, **options: Any) -> ServerThread:
        config = ServiceConfig(store=str(tmp_path / "store"), index_dir=str(tmp_path / index), port=0,
                               store_options=LEASE, **options)
        started.append(ServerThread(config))
        return started[-1]

    yield start
    for s in reversed(started):
        s.stop()


@pytest.mark.parametrize("standby_index", ["standby-index", "writer-index"])  # two machines; one machine
def test_standby_serves_reads_refuses_writes_and_takes_over_when_the_writer_closes(
        serve: Callable[..., ServerThread], tmp_path: Path, standby_index: str) -> None:
    writer = serve("writer-index")
    standby = serve(standby_index, standby=True)
    health = _wait_for(lambda: (h := _health(standby.url)).get("writer_url") and h, "the standby to see the writer")
    assert health == health | {"status": "standby", "writable": False, "writer_url": writer.url, "writer_epoch": 1}
    with SyncMintClient(writer.url) as w, SyncMintClient(standby.url) as s:
        acked = w.publish("acme", "chat", random_adapter(1))
        _wait_for(lambda: _health(standby.url)["last_seq"] >= acked.seq, "the standby's index to catch up")
        assert s.read("acme/chat")[0].content_id == acked.content_id  # reads from its own index
        with pytest.raises(NotTheWriter, match="standby") as info:
            s.tag("acme/chat@1", "prod")
        assert isinstance(info.value, ReadOnlyStore) and info.value.writer_url == writer.url
        req = urllib.request.Request(standby.url + "/v1/adapters/acme/chat/versions/1?x=1", method="DELETE")
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=DEADLINE_S)
        assert http.value.code == 405 and http.value.headers["Allow"] == "GET, HEAD"
        assert http.value.headers["Location"] == writer.url + "/v1/adapters/acme/chat/versions/1?x=1"
        body = json.loads(http.value.read())
        assert body["error"] == "not_the_writer" and body["writer_url"] == writer.url
        assert w.version("acme/chat").deleted is False  # the refused writes changed nothing
    writer.stop()  # releases the lease: the standby need not wait for its expiry
    _wait_for(lambda: _health(standby.url).get("writable"), "the standby to take over")
    lease = json.loads(open_storage(str(tmp_path / "store")).get(LEASE_KEY))
    assert lease["epoch"] == 2 and lease["holder"]["url"] == standby.url
    with SyncMintClient(standby.url) as s:
        assert s.tag("acme/chat@1", "prod") == 1
        nxt = s.publish("acme", "chat", random_adapter(2))
        assert nxt.version == 2 and s.events(0).last_seq == nxt.seq == acked.seq + 2
        assert s.read("acme/chat:prod")[0].content_id == acked.content_id


def test_standby_on_a_store_without_writer_becomes_the_writer(serve: Callable[..., ServerThread],
                                                               tmp_path: Path) -> None:
    standby = serve("standby-index", standby=True)
    _wait_for(lambda: _health(standby.url).get("writable"), "the standby to take the free lease")
    with SyncMintClient(standby.url) as s:
        assert s.publish("acme", "chat", random_adapter(1)).version == 1
    lease = json.loads(open_storage(str(tmp_path / "store")).get(LEASE_KEY))
    assert lease["epoch"] == 1 and lease["holder"]["url"] == standby.url


def test_standby_and_readonly_together_are_refused() -> None:
    with pytest.raises(ValueError, match="standby"):
        ServiceConfig(standby=True, readonly=True)


def test_standby_beside_a_writer_without_http_refuses_writes_without_a_url(
        serve: Callable[..., ServerThread], tmp_path: Path) -> None:
    from mint_store.store import Store

    with Store.open(str(tmp_path / "store"), index_dir=str(tmp_path / "trainer-index"), **LEASE) as trainer:
        standby = serve("standby-index", standby=True)
        _wait_for(lambda: _health(standby.url).get("writer_epoch") == 1, "the standby to see the lease")
        assert _health(standby.url)["writer_url"] is None
        req = urllib.request.Request(standby.url + "/v1/adapters/acme/chat", method="PUT", data=b"x")
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=DEADLINE_S)
        assert http.value.code == 405 and "Location" not in http.value.headers
        with SyncMintClient(standby.url) as s, pytest.raises(NotTheWriter, match="advertised no URL") as info:
            s.register_base("tiny", {"m": [4, 4]})
        assert info.value.writer_url is None
        trainer.publish("acme", "chat", random_adapter(1))  # the writer is untouched
