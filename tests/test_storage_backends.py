"""Every storage backend against one contract (tests/support/storage_suite.py): a local
directory, fsspec's memory://, and S3 through s3fs on moto's server on loopback."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mint_store.errors import BlobNotFound
from mint_store.storage import local, open_storage
from tests.support.storage_suite import StorageTests
from tests.support.targets import make_bucket, s3_options


class TestLocalStorage(StorageTests):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> Iterator[Any]:
        s = open_storage(str(tmp_path / "s"))
        yield s
        s.close()

    @pytest.fixture
    def outside(self, tmp_path: Path) -> Iterator[Any]:
        s = open_storage(str(tmp_path))
        yield s
        s.close()


def test_local_reads_keep_their_descriptor_while_the_cache_evicts_it(tmp_path: Path) -> None:
    """Eviction closes a cached descriptor only once no read holds it: closed under a read, its
    number went to the next file opened and the read went on in another shard's bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from mint_store.storage.local import LocalStorage

    s = LocalStorage(tmp_path / "s", max_open_files=2)
    data = {f"k{i}": bytes([i]) * 4096 for i in range(6)}
    for k, v in data.items():
        s.put(k, v)
    held = s.hold("k0")
    for k in ("k1", "k2", "k3"):  # k0 is evicted from the cache while held
        s.read_into(k, 0, memoryview(bytearray(16)))
    assert "k0" not in s._fds and held.dropped
    os.fstat(held.fd)  # still open: its reader has not let go
    buf = bytearray(4096)
    os.preadv(held.fd, [buf], 0)
    assert bytes(buf) == data["k0"]
    s.release(held)
    with pytest.raises(OSError):
        os.fstat(held.fd)  # closed by its last reader

    wrong: list[str] = []

    def reader(seed: int) -> None:  # many readers racing the evictions: every read its own bytes
        for i in range(3000):
            k = f"k{(seed + i * 7) % 6}"
            got = bytearray(4096)
            s.read_into(k, 0, memoryview(got))
            if bytes(got) != data[k]:
                wrong.append(k)

    with ThreadPoolExecutor(4) as pool:  # (map's results: a reader's exception is raised here)
        list(pool.map(reader, range(4)))
    assert not wrong
    s.close()


def test_local_reads_drop_a_cached_shard_another_process_deleted(tmp_path: Path) -> None:
    """A reader's cached descriptor of a shard the writer has swept is dropped at its next read
    after the recheck interval (BlobNotFound), so the reader neither serves deleted bytes for
    long nor pins their disk space."""
    reader, writer = open_storage(str(tmp_path / "s")), open_storage(str(tmp_path / "s"))
    writer.put("packs/a", b"x" * 100)
    got = bytearray(10)
    reader.read_into("packs/a", 0, memoryview(got))
    fd = reader._fds["packs/a"].fd
    writer.delete("packs/a")
    time.sleep(local.RECHECK_S * 1.5)  # (the descriptor's "still linked" check runs this often)
    with pytest.raises(BlobNotFound):
        reader.read_into("packs/a", 0, memoryview(got))
    assert "packs/a" not in reader._fds
    with pytest.raises(OSError):
        os.fstat(fd)
    reader.close()
    writer.close()


class TestMemoryStorage(StorageTests):
    @pytest.fixture
    def root(self) -> str:
        return f"memory://mint-{uuid.uuid4().hex[:8]}"

    @pytest.fixture
    def storage(self, root: str) -> Iterator[Any]:
        s = open_storage(f"{root}/p")
        yield s
        s.close()

    @pytest.fixture
    def outside(self, root: str) -> Iterator[Any]:
        s = open_storage(root)
        yield s
        s.close()


class TestS3Storage(StorageTests):
    @pytest.fixture
    def bucket(self, s3_endpoint: str) -> str:
        return make_bucket(s3_endpoint)

    @pytest.fixture
    def storage(self, s3_endpoint: str, bucket: str) -> Iterator[Any]:
        s = open_storage(f"s3://{bucket}/p", storage_options=s3_options(s3_endpoint))
        yield s
        s.close()

    @pytest.fixture
    def outside(self, s3_endpoint: str, bucket: str) -> Iterator[Any]:
        """The bucket's root: a key escaping the prefix ``p/`` would land here."""
        s = open_storage(f"s3://{bucket}", storage_options=s3_options(s3_endpoint))
        yield s
        s.close()

    def test_a_replace_whose_precondition_fails_against_its_own_bytes_is_done(self, storage: Any) -> None:
        """s3fs retries a PUT by itself: a retry of an If-Match PUT that landed (its answer lost)
        fails the precondition against the object it just wrote. The lease record names its
        holder and expiry, so finding exactly our bytes means the write was ours."""
        from mint_store.errors import ObjectChanged

        storage.put("writer.lease", b"v1")
        stale = storage.get_with_token("writer.lease")[1]
        storage.replace_if("writer.lease", b"v2", stale)
        storage.replace_if("writer.lease", b"v2", stale)  # as the internal retry sends it again
        with pytest.raises(ObjectChanged):
            storage.replace_if("writer.lease", b"v3", stale)
        assert storage.get("writer.lease") == b"v2"
