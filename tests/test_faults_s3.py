"""S3 transient faults: a connection reset between the store and a real S3 server (moto on
loopback, behind a TCP relay that drops requests on demand) is retried by the storage layer."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mint_store.storage.retry import RetryPolicy
from mint_store.store import Store
from tests.support.factories import random_adapter
from tests.support.targets import make_bucket, s3_options


class ResettingRelay:
    """A TCP relay to ``upstream``; ``drop(n)`` resets the connection that carries each of the
    next ``n`` requests (an RST before a byte reaches the server, as a dropped link does)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.to_drop = 0
        self.dropped = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def drop(self, n: int) -> None:
        with self.lock:
            self.to_drop += n

    def _take_drop(self) -> bool:
        with self.lock:
            if self.to_drop <= 0:
                return False
            self.to_drop -= 1
            self.dropped += 1
            return True

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if from_client and self._take_drop():
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()


@pytest.fixture
def relay(s3_endpoint: str) -> Iterator[ResettingRelay]:
    host, port = s3_endpoint.removeprefix("http://").split(":")
    r = ResettingRelay((host, int(port)))
    yield r
    r.close()


def test_connection_resets_on_s3_are_retried_and_the_publish_succeeds(
    tmp_path: Path, s3_endpoint: str, relay: ResettingRelay
) -> None:
    bucket = make_bucket(s3_endpoint)
    options = s3_options(f"http://127.0.0.1:{relay.port}")
    options["config_kwargs"] = {"retries": {"total_max_attempts": 1}}  # botocore: no retries of its own
    a, b = random_adapter(1), random_adapter(2)
    with Store.open(f"s3://{bucket}/mint", index_dir=str(tmp_path / "index"), storage_options=options,
                    retry=RetryPolicy(attempts=4, base_s=0.01, max_s=0.05)) as store:
        store.publish("acme", "a", a)
        # more resets in a row than s3fs's own five attempts: only the store's retry gets through
        relay.drop(6)
        result = store.publish("acme", "b", b)
        assert relay.dropped == 6 and result.version == 1 and result.seq == 2
        assert store.health() == {"writable": True, "failures": 0, "recoveries": 0}
        for ref, ad in (("acme/a", a), ("acme/b", b)):
            got = store.load(ref)
            for m0, m1 in zip(ad.modules, got.modules, strict=True):
                assert torch.equal(m0.a, m1.a) and torch.equal(m0.b, m1.b)
