"""``mint serve --standby``: a second server takes the writer role when the first one dies or stalls.

Real ``mint serve`` subprocesses on one store (a local directory, and S3 on moto's
ThreadedMotoServer), each with its own index directory as on two machines, and short
lease TTLs. Every wait polls a state (``/healthz``, the lease object); nothing asserts
a duration.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine_client import SyncMintClient
from mint_store.errors import AdapterNotFound, NotTheWriter, WriterFenced
from mint_store.index.commit_log import log_key
from mint_store.storage import Storage, open_storage
from mint_store.testing.serve_proc import WAIT_S, ServeProcess, wait_until
from mint_store.write.lease import LEASE_KEY
from tests.support.factories import random_adapter
from tests.support.targets import make_bucket, s3_options

DEADLINE_S = WAIT_S  # a bound for waits on another process, never a pass/fail threshold
TTL_S, RENEW_S = 2.0, 0.3
pytestmark = pytest.mark.slow


@dataclass
class Where:
    url: str
    env: dict[str, str]
    storage_options: dict[str, Any] | None

    def storage(self) -> Storage:
        return open_storage(self.url, storage_options=self.storage_options)


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    root = str(Path(__file__).resolve().parents[1])  # the repository
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    if request.param == "local":
        return Where(str(tmp_path / "store"), env, None)
    endpoint = request.getfixturevalue("s3_endpoint")
    env |= {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    return Where(f"s3://{make_bucket(endpoint)}/mint", env, s3_options(endpoint))


class Server(ServeProcess):
    """One ``mint serve`` of the test's store, with the test's short lease."""

    def __init__(self, where: Where, index: Path, *, standby: bool = False) -> None:
        super().__init__(where.url, index, where.env, TTL_S, RENEW_S, standby=standby)

    def client(self, **options: Any) -> SyncMintClient:
        return SyncMintClient(self.url, **options)


@pytest.fixture
def servers(where: Where, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(name: str, *, standby: bool = False) -> Server:
        started.append(Server(where, tmp_path / name, standby=standby))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def _lease(where: Where) -> dict[str, Any]:
    return dict(json.loads(where.storage().get(LEASE_KEY)))


def _publish_series(client: SyncMintClient, seeds: range) -> dict[int, str]:
    """Publish one adapter per seed; every return is an acknowledgement: seed -> content id."""
    return {seed: client.publish("acme", f"a{seed}", random_adapter(seed)).content_id for seed in seeds}


def _assert_exact(client: SyncMintClient, acked: dict[int, str]) -> None:
    for seed, cid in acked.items():
        loc, row = client.read(f"acme/a{seed}")
        assert loc.content_id == cid
        assert bytes(row) == random_adapter(seed).to_row()[1].tobytes()


def _took_over(standby: Server) -> bool:
    h = standby.health()
    return h.get("status") == "ok" and h.get("writable") is True


def test_standby_refuses_writes_naming_the_writer_and_takes_over_after_sigkill(
        where: Where, servers: Callable[..., Server]) -> None:
    writer = servers("writer")
    standby = servers("standby", standby=True)
    health = wait_until(lambda: (h := standby.health()).get("writer_url") == writer.url and h, "the standby")
    assert health["status"] == "standby" and health["writable"] is False and health["writer_epoch"] == 1
    with writer.client() as w, standby.client() as s:
        acked = _publish_series(w, range(1, 7))
        # a write to the standby is refused with the writer's URL, and nothing is stored
        with pytest.raises(NotTheWriter) as info:
            s.publish("acme", "refused", random_adapter(99))
        assert info.value.writer_url == writer.url
        req = urllib.request.Request(standby.url + "/v1/adapters/acme/a1/tags/prod", method="PUT",
                                     data=b'{"version": 1}', headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=DEADLINE_S)
        assert http.value.code == 405
        assert http.value.headers["Location"] == writer.url + "/v1/adapters/acme/a1/tags/prod"
        assert json.loads(http.value.read())["writer_url"] == writer.url
        # the standby serves reads from its own index, caught up from the log
        wait_until(lambda: standby.health()["last_seq"] >= w.events(0).last_seq, "the standby to catch up")
        _assert_exact(s, acked)
        # publishes the standby has not seen when the writer dies: replayed before it takes writes
        os.kill(standby.proc.pid, signal.SIGSTOP)
        try:
            acked |= _publish_series(w, range(7, 10))
            writer.proc.send_signal(signal.SIGKILL)
            writer.proc.wait(DEADLINE_S)
        finally:
            os.kill(standby.proc.pid, signal.SIGCONT)
    resumed = time.monotonic()
    wait_until(lambda: _took_over(standby), "the standby to take over")
    print(f"failover (writer SIGKILLed, standby resumed -> standby writable): {time.monotonic() - resumed:.2f} s")
    lease = _lease(where)
    assert lease["epoch"] == 2 and lease["holder"]["url"] == standby.url
    with standby.client() as s:
        _assert_exact(s, acked)  # every acknowledged publish, exactly
        with pytest.raises(AdapterNotFound):
            s.resolve("acme/refused")
        more = s.publish("acme", "a1", random_adapter(70))
        assert more.version == 2 and s.read("acme/a1")[0].content_id == more.content_id
    assert json.loads(where.storage().get(log_key(more.seq)))["epoch"] == 2


def test_a_stalled_writer_is_fenced_after_the_standby_takes_over(
        where: Where, servers: Callable[..., Server]) -> None:
    writer = servers("writer")
    standby = servers("standby", standby=True)
    wait_until(lambda: standby.health().get("writer_url") == writer.url, "the standby")
    with writer.client(retries=0) as w:
        before = _publish_series(w, range(1, 4))
        os.kill(writer.proc.pid, signal.SIGSTOP)  # past the TTL: it stops renewing
        stopped = time.monotonic()
        wait_until(lambda: _took_over(standby), "the standby to take over")
        print(f"failover (writer SIGSTOPped -> standby writable): {time.monotonic() - stopped:.2f} s")
        with standby.client() as s:
            after = _publish_series(s, range(4, 7))
            os.kill(writer.proc.pid, signal.SIGCONT)
            with pytest.raises(WriterFenced):  # writer_fenced, or commit_conflict (a subclass)
                w.publish("acme", "zombie", random_adapter(9))
            # nothing of the zombie's is visible; everything acknowledged is, exactly
            with pytest.raises(AdapterNotFound):
                s.resolve("acme/zombie")
            _assert_exact(s, before | after)
            last = s.events(0).last_seq
    storage = where.storage()
    epochs = [json.loads(storage.get(log_key(seq))).get("epoch") for seq in range(1, last + 1)]
    assert epochs == [1] * len(before) + [2] * len(after)
    assert not storage.exists(log_key(last + 1))
    assert _lease(where)["epoch"] == 2 and _lease(where)["holder"]["url"] == standby.url
