"""Large reads on S3 (moto's server on loopback) go as concurrent ranged GETs, each part landing
in its slice of the caller's buffer (FsspecStorage.read_into, ``read_part_bytes`` and
``read_concurrency``); the error semantics are those of one GET."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mint_store.errors import BlobNotFound
from mint_store.storage import FsspecStorage, open_storage
from mint_store.storage.remote import read_parts
from tests.support.targets import make_bucket, s3_options

pytestmark = pytest.mark.s3

PART = 64 * 1024
DATA = os.urandom((1 << 20) + 12_345)  # ~1 MiB: 17 parts of 64 KiB


class Recorder:
    """Wraps one filesystem instance's async ``_cat_file``: every ranged GET it issues and the
    most in flight at once (each held ``delay`` seconds first, so GETs issued together overlap
    for sure and GETs issued one after another never do)."""

    def __init__(self, fs: Any, delay: float = 0.02, fail_first: bool = False) -> None:
        self.calls: list[tuple[int, int]] = []
        self.in_flight = self.peak = 0
        self.done = 0
        self._orig = fs._cat_file
        self.delay, self.fail_first = delay, fail_first
        fs._cat_file = self

    async def __call__(self, path: str, start: int | None = None, end: int | None = None, **kw: Any) -> Any:
        assert start is not None and end is not None  # always a ranged GET
        first = not self.calls
        self.calls.append((start, end))
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if first and self.fail_first:
                raise FileNotFoundError(path)
            await asyncio.sleep(self.delay)
            return await self._orig(path, start=start, end=end, **kw)
        finally:
            self.in_flight -= 1
            self.done += 1


@pytest.fixture
def s3(s3_endpoint: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield f"s3://{make_bucket(s3_endpoint)}/mint", s3_options(s3_endpoint)


def _storage(s3: tuple[str, dict[str, Any]], **read: Any) -> FsspecStorage:
    url, opts = s3
    s = open_storage(url, storage_options={**opts, **read})
    assert isinstance(s, FsspecStorage)
    return s


def test_a_large_read_is_concurrent_ranged_gets_filling_the_buffer_exactly(s3: Any) -> None:
    s = _storage(s3, read_part_bytes=PART)
    s.put("packs/big", DATA)
    rec = Recorder(s.fs)
    buf = bytearray(len(DATA))
    s.read_into("packs/big", 0, memoryview(buf))
    assert bytes(buf) == DATA
    parts = -(-len(DATA) // PART)
    assert parts == 17 and len(rec.calls) == parts
    # the parts tile the read exactly, none over the part size, and all were in flight together
    assert sorted(rec.calls) == [(lo, hi) for lo, hi in read_parts(len(DATA), PART)]
    assert sorted(rec.calls)[0][0] == 0 and sorted(rec.calls)[-1][1] == len(DATA)
    assert all(0 < hi - lo <= PART for lo, hi in rec.calls)
    assert rec.peak == 16  # all in flight together, up to the default concurrency (16 of the 17)
    s.close()


def test_odd_offset_and_length_and_the_concurrency_cap(s3: Any) -> None:
    s = _storage(s3, read_part_bytes=PART, read_concurrency=3)
    s.put("packs/big", DATA)
    rec = Recorder(s.fs)
    off, n = 77_777, 654_321
    buf = bytearray(n)
    s.read_into("packs/big", off, memoryview(buf))
    assert bytes(buf) == DATA[off : off + n]
    assert sorted(rec.calls) == [(off + lo, off + hi) for lo, hi in read_parts(n, PART)]
    assert len(rec.calls) == 10 and rec.peak == 3  # never more than read_concurrency at once
    # a slice of a bigger buffer (as read_row hands a row-sized view of a pinned block)
    big = bytearray(n + 100)
    s.read_into("packs/big", off, memoryview(big)[50 : 50 + n])
    assert bytes(big[50 : 50 + n]) == DATA[off : off + n] and big[:50] == bytes(50) and big[-50:] == bytes(50)
    s.close()


def test_reads_under_two_parts_and_concurrency_one_are_one_get(s3: Any) -> None:
    s = _storage(s3, read_part_bytes=PART)
    s.put("packs/big", DATA)
    rec = Recorder(s.fs)
    buf = bytearray(2 * PART - 1)  # under the threshold: one GET, not through the parallel path
    s.read_into("packs/big", 5, memoryview(buf))
    assert bytes(buf) == DATA[5 : 5 + len(buf)] and rec.calls == []
    one = _storage(s3, read_part_bytes=PART, read_concurrency=1)
    rec = Recorder(one.fs)
    buf = bytearray(len(DATA))
    one.read_into("packs/big", 0, memoryview(buf))
    assert bytes(buf) == DATA and rec.calls == []
    s.close()
    one.close()


def test_the_default_parts_are_8_mib_from_16_mib_up_and_the_pool_holds_16_connections(s3: Any) -> None:
    s = _storage(s3)
    assert (s.read_part_bytes, s.read_concurrency) == (8 << 20, 16)
    assert s._opts["config_kwargs"] == {"max_pool_connections": 16}
    assert "read_part_bytes" not in s._opts and "read_concurrency" not in s._opts  # not fsspec's
    assert [hi - lo for lo, hi in read_parts(64 << 20, 8 << 20)] == [8 << 20] * 8
    sizes = [hi - lo for lo, hi in read_parts(17 << 20, 8 << 20)]  # even parts, not 8 + 8 + 1 MiB
    assert len(sizes) == 3 and sum(sizes) == 17 << 20 and max(sizes) - min(sizes) <= 1
    url, opts = s3  # a pool size the caller chose is left alone, and its other settings kept
    mine = open_storage(url, storage_options={**opts, "config_kwargs": {"max_pool_connections": 4,
                                                                         "retries": {"total_max_attempts": 1}}})
    assert isinstance(mine, FsspecStorage)
    assert mine._opts["config_kwargs"] == {"max_pool_connections": 4, "retries": {"total_max_attempts": 1}}
    s.close()
    mine.close()


def test_short_and_missing_objects_are_blob_not_found(s3: Any) -> None:
    s = _storage(s3, read_part_bytes=PART)
    s.put("packs/big", DATA)
    n = len(DATA)
    for off, length in ((0, n + 1), (n - 10, 4 * PART), (n + 5, 4 * PART), (n - 3 * PART, 4 * PART)):
        buf = bytearray(length)
        with pytest.raises(BlobNotFound, match=f"is shorter than {off + length} bytes"):
            s.read_into("packs/big", off, memoryview(buf))
    with pytest.raises(BlobNotFound, match="not found"):
        s.read_into("packs/missing", 0, memoryview(bytearray(4 * PART)))
    with pytest.raises(ValueError, match="offset -1 < 0"):
        s.read_into("packs/big", -1, memoryview(bytearray(4 * PART)))
    s.read_into("packs/big", 0, memoryview(bytearray(0)))  # empty: only the object must exist
    with pytest.raises(BlobNotFound):
        s.read_into("packs/missing", 0, memoryview(bytearray(0)))
    s.close()


def test_a_failed_part_cancels_the_rest_and_nothing_lands_after_the_error(s3: Any) -> None:
    s = _storage(s3, read_part_bytes=PART)
    s.put("packs/big", DATA)
    rec = Recorder(s.fs, delay=0.3, fail_first=True)
    buf = bytearray(len(DATA))
    started = time.perf_counter()
    with pytest.raises(BlobNotFound, match="not found"):
        s.read_into("packs/big", 0, memoryview(buf))
    assert time.perf_counter() - started < 0.25  # the others were cancelled, not waited out
    assert rec.in_flight == 0 and rec.done == len(rec.calls)  # every GET ended before the raise
    time.sleep(0.4)
    assert buf == bytearray(len(DATA))  # and none wrote into the buffer afterwards
    s.close()


@pytest.mark.parametrize("option, value", [
    ("read_part_bytes", 1000), ("read_part_bytes", "8MiB"), ("read_part_bytes", True), ("read_part_bytes", 2.0**20),
    ("read_concurrency", 0), ("read_concurrency", 257), ("read_concurrency", "16"), ("read_concurrency", None),
])
def test_a_bad_read_option_is_a_clear_error(s3: Any, tmp_path: Path, option: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"storage option {option} must be an integer .*not {value!r}"):
        _storage(s3, **{option: value})
    from mint_store.store import Store

    url, opts = s3
    with pytest.raises(ValueError, match=f"storage option {option}"):
        Store.open(url, index_dir=str(tmp_path / "index"), storage_options={**opts, option: value})


def test_a_filesystem_that_is_not_async_reads_with_one_get() -> None:
    s = open_storage("memory://mint-parallel-test/p", storage_options={"read_part_bytes": PART})
    assert isinstance(s, FsspecStorage) and not s._parallel
    s.put("packs/big", DATA)
    buf = bytearray(len(DATA) - 3)
    s.read_into("packs/big", 3, memoryview(buf))
    assert bytes(buf) == DATA[3:]
    with pytest.raises(BlobNotFound, match="is shorter than"):
        s.read_into("packs/big", 3, memoryview(bytearray(len(DATA))))
    s.delete("packs/big")


def test_a_store_on_s3_reads_and_verifies_a_row_in_parts(s3: Any, tmp_path: Path) -> None:
    from mint_store.store import Store
    from tests.support.factories import random_adapter

    url, opts = s3
    adapter = random_adapter(3, rank=64, layers=4)  # a row of ~260 KB: 5 parts
    with Store.open(url, index_dir=str(tmp_path / "index"), storage_options={**opts, "read_part_bytes": PART}) as st:
        st.publish("acme", "big", adapter)
        loc = st.resolve("acme/big")
        assert loc.length >= 2 * PART, loc.length  # large enough to go in parts
        rec = Recorder(st.storage.fs)
        row = st.read_row(loc)  # verified against its content id
        assert len(rec.calls) == len(read_parts(loc.length, PART)) > 1 and rec.peak == len(rec.calls)
        assert bytes(row[: loc.length]) == adapter.to_row()[1].tobytes()
