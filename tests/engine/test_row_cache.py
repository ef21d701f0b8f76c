"""The local disk cache of rows (row_cache.py): hits and misses through the streamer, LRU
eviction by bytes, corrupt files refetched, and two processes sharing one directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engine_client import MintClient
from engine_client.stream.host_pool import HostPool
from engine_client.stream.row_cache import TMP_PREFIX, RowCache
from engine_client.stream.streamer import Streamer, StreamerConfig
from mint_store.format.hashing import content_id
from mint_store.results import Location
from tests.support.engine import publish_random
from tests.support.targets import StoreTarget

N = 6
LAYOUT = "0" * 32


def _row(seed: int, n: int = 4096) -> tuple[Location, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)
    return Location(content_id(LAYOUT, data), LAYOUT, "packs/x", 0, n, seed), data


@pytest.fixture
def published(local_target: StoreTarget) -> dict[str, np.ndarray]:
    return publish_random(local_target, N)


def _streamer(client: MintClient, cache_dir: Path, **options: int) -> Streamer:
    return Streamer(client, HostPool(1 << 20), config=StreamerConfig(row_cache_dir=str(cache_dir), **options))


async def test_rows_come_from_the_disk_cache_once_read(client: MintClient, published: dict[str, np.ndarray],
                                                       local_target: StoreTarget, tmp_path: Path) -> None:
    first = _streamer(client, tmp_path / "rows")
    locs = await first.prefetch(list(published))
    assert first.row_cache is not None
    stats = first.row_cache.stats()
    assert (stats.hits, stats.misses, stats.writes) == (0, N, N)
    # a new streamer (an empty host cache, as in another engine process) with the storage's rows gone
    shutil.rmtree(Path(local_target.url) / "packs")
    second = _streamer(client, tmp_path / "rows")
    for (ref, row), loc in zip(published.items(), locs, strict=True):
        with await second.fetch(loc) as lease:
            assert np.array_equal(lease.tensor.numpy(), row), ref
    assert second.row_cache is not None
    stats = second.row_cache.stats()
    assert (stats.hits, stats.misses, stats.corrupt) == (N, 0, 0)
    assert second.metrics.snapshot().tiers["storage"].count == N  # below the host cache: the disk


async def test_a_corrupt_or_torn_file_is_deleted_and_refetched(client: MintClient, published: dict[str, np.ndarray],
                                                               tmp_path: Path) -> None:
    first = _streamer(client, tmp_path / "rows")
    locs = await first.prefetch(list(published)[:2])
    assert first.row_cache is not None
    flipped, torn = (first.row_cache.path(loc.content_id) for loc in locs)
    raw = bytearray(Path(flipped).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    Path(flipped).write_bytes(raw)
    Path(torn).write_bytes(Path(torn).read_bytes()[:100])
    second = _streamer(client, tmp_path / "rows")
    for ref, loc in zip(published, locs, strict=False):
        with await second.fetch(loc) as lease:
            assert np.array_equal(lease.tensor.numpy(), published[ref])
    assert second.row_cache is not None
    stats = second.row_cache.stats()
    assert (stats.hits, stats.misses, stats.corrupt, stats.writes) == (0, 2, 2, 2)
    # the cache holds the right bytes again
    out = np.empty(locs[0].length, dtype=np.uint8)
    assert second.row_cache.load(locs[0], out) and np.array_equal(out, published[next(iter(published))])


def test_lru_eviction_by_bytes(tmp_path: Path) -> None:
    rows = [_row(i) for i in range(5)]
    size = rows[0][0].length
    cache = RowCache(tmp_path / "rows", max_bytes=3 * size)
    for loc, data in rows[:3]:
        cache.store(loc, data)
    out = np.empty(size, dtype=np.uint8)
    assert cache.load(rows[0][0], out) and np.array_equal(out, rows[0][1])  # 0 is now the most recent
    cache.store(*rows[3])  # over budget: the least recently used (1) goes
    ids = [loc.content_id for loc, _ in rows]
    assert cache.keys_lru_first() == [ids[2], ids[0], ids[3]]
    assert not cache.load(rows[1][0], out)
    cache.store(*rows[4])
    assert cache.keys_lru_first() == [ids[0], ids[3], ids[4]]
    big, data = _row(9, n=4 * size)  # larger than the whole cache: never stored
    cache.store(big, data)
    assert big.content_id not in cache.keys_lru_first()
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evicted, stats.writes) == (1, 1, 2, 5)
    assert sum(p.stat().st_size for p in (tmp_path / "rows").iterdir()) == 3 * size


_WORKER = textwrap.dedent(
    """
    import random, sys
    import numpy as np
    from engine_client.stream.row_cache import RowCache
    from mint_store.format.hashing import content_id
    from mint_store.results import Location

    directory, seed = sys.argv[1], int(sys.argv[2])
    n, rows, budget = 65536, 24, 6 * 65536

    def row(i):
        data = np.random.default_rng(i).integers(0, 256, size=n, dtype=np.uint8)
        return Location(content_id("0" * 32, data), "0" * 32, "packs/x", 0, n, i), data

    cache = RowCache(directory, budget)
    rng = random.Random(seed)
    out = np.empty(n, dtype=np.uint8)
    for _ in range(400):
        loc, data = row(rng.randrange(rows))
        if cache.load(loc, out):
            assert np.array_equal(out, data)
        else:
            cache.store(loc, data)
    s = cache.stats()
    print(s.hits, s.misses, s.corrupt, s.evicted, flush=True)
    """
)


def test_two_processes_share_one_cache_directory(tmp_path: Path) -> None:
    directory = tmp_path / "rows"
    root = str(Path(__file__).parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(directory), str(seed)], stdout=subprocess.PIPE,
                              text=True, env=env) for seed in (1, 2)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
        results.append([int(x) for x in out.split()])
    for hits, misses, corrupt, evicted in results:
        assert hits > 0 and misses > 0 and evicted > 0
        assert corrupt == 0  # no reader ever saw a half-written row: writes are renamed into place
    cache = RowCache(directory, 6 * 65536)
    cache.trim()
    names = os.listdir(directory)
    assert not any(n.startswith(TMP_PREFIX) for n in names)
    assert sum((directory / n).stat().st_size for n in names) <= 6 * 65536
    for cid in cache.keys_lru_first():  # every file left is a whole, verified row
        data = (directory / f"{cid}.row").read_bytes()
        assert content_id(LAYOUT, data) == cid


def test_temp_files_of_a_dead_writer_are_swept_and_never_read(tmp_path: Path) -> None:
    loc, data = _row(1)
    cache = RowCache(tmp_path / "rows", max_bytes=loc.length)
    stale = tmp_path / "rows" / f"{TMP_PREFIX}{loc.content_id}-1-dead"
    stale.write_bytes(data.tobytes()[:10])  # a writer killed mid-write; never renamed
    os.utime(stale, (0, 0))
    fresh = tmp_path / "rows" / f"{TMP_PREFIX}{loc.content_id}-2-live"
    fresh.write_bytes(b"")  # a writer still at work
    out = np.empty(loc.length, dtype=np.uint8)
    assert not cache.load(loc, out)  # a temp file is not the row
    cache.trim()
    assert not stale.exists() and fresh.exists()
    cache.store(loc, data)
    assert cache.load(loc, out) and np.array_equal(out, data)
