"""The one verified row read (mint_store.read.verified): the compiled one-pass reader and the
Python path give the same bytes and the same verdicts, on every size a row can have."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from mint_store.errors import BlobNotFound, IntegrityError
from mint_store.format.hashing import content_id
from mint_store.read import ReadConfig, configure, empty_row, read_verified, row_buffer, verified
from mint_store.read import native as native_reader
from mint_store.read.buffers import PAGE, PAGE_ALIGNED_FROM
from mint_store.results import Location
from mint_store.storage import LocalStorage

LAYOUT = "0123456789abcdef" * 2  # a layout id as the writer forms them (32 hex digits)
# one byte, a small row, chunk edges, rows the workers split, a row past one sink segment
SIZES = [0, 1, 9_152, 32 * 1024, 143_936, 575_552, 4_129_792 + 3, verified.SEGMENT + 12_345]
PAD = 777  # rows start at odd offsets, as in a shard


@pytest.fixture(params=["mapped", "native", "python"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    """mapped: rows under MAPPED_MAX copied from the shard's mapping, larger ones by preadv;
    native: the compiled preadv reader for every row; python: no compiled code."""
    if request.param != "python" and native_reader.reader(2) is None:
        pytest.skip("the compiled reader cannot be built here (no C compiler or Python headers)")
    configure(ReadConfig(threads=2, native=request.param != "python", mapped=request.param == "mapped"))
    yield request.param
    configure(ReadConfig.from_env())


def _shard(tmp_path: Path, sizes: list[int]) -> tuple[LocalStorage, list[Location], np.ndarray]:
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, PAD + sum(sizes), dtype=np.uint8)
    storage = LocalStorage(tmp_path / "s")
    storage.put("packs/p", data.tobytes())
    locs, off = [], PAD
    for i, n in enumerate(sizes):
        locs.append(Location(content_id(LAYOUT, data[off : off + n]), LAYOUT, "packs/p", off, n, i))
        off += n
    return storage, locs, data


def test_every_size_reads_the_exact_bytes_verified(tmp_path: Path, path: str) -> None:
    storage, locs, data = _shard(tmp_path, SIZES)
    for loc in locs:
        out = np.full(loc.length + 5, 0xEE, np.uint8)  # a larger buffer: only the row's bytes are written
        read_verified(storage, loc, out)
        assert np.array_equal(out[: loc.length], data[loc.offset : loc.offset + loc.length])
        assert (out[loc.length :] == 0xEE).all()


def test_a_new_destination_starts_on_a_page_or_a_cache_line_and_holds_the_row(tmp_path: Path, path: str) -> None:
    # the kernel's copy is several times slower into a destination 1 to 31 bytes past its
    # source modulo 4 KiB (mint_store/read/buffers.py), as a large numpy.empty lies (16 bytes
    # past a page): a new destination starts on a page, a small one on 64 bytes
    storage, locs, data = _shard(tmp_path, SIZES)
    for loc in locs:
        out = row_buffer(loc.length)[0]
        align = PAGE if loc.length >= PAGE_ALIGNED_FROM else 64
        assert out.shape == (loc.length,) and out.dtype == np.uint8
        assert loc.length == 0 or out.ctypes.data % align == 0  # (no address to speak of for no bytes)
        read_verified(storage, loc, out)
        assert np.array_equal(out, data[loc.offset : loc.offset + loc.length])
    with pytest.raises(ValueError, match="negative"):
        empty_row(-1)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_flipped_byte_anywhere_fails_the_read(tmp_path: Path, path: str, where: str) -> None:
    storage, locs, data = _shard(tmp_path, [9_152, 4_129_792 + 3])
    for loc in locs:
        at = {"first": 0, "middle": loc.length // 2, "last": loc.length - 1}[where]
        bad = data.copy()
        bad[loc.offset + at] ^= 1
        _rewrite(storage, bad)
        with pytest.raises(IntegrityError, match="does not match its content id"):
            read_verified(storage, loc, np.empty(loc.length, np.uint8))
        read_verified(storage, loc, np.empty(loc.length, np.uint8), verify=False)  # unverified: read as is
        _rewrite(storage, data)


def _rewrite(storage: LocalStorage, data: np.ndarray) -> None:
    p = storage.local_path("packs/p")
    assert p is not None
    with open(p, "r+b") as f:  # in place: the cached descriptor sees the new bytes
        f.write(data.tobytes())


def test_a_shard_shorter_than_the_row_is_not_found(tmp_path: Path, path: str) -> None:
    storage, locs, _ = _shard(tmp_path, [4_129_792])
    loc = locs[0]
    p = storage.local_path("packs/p")
    assert p is not None
    os.truncate(p, loc.offset + loc.length - 10)
    with pytest.raises(BlobNotFound, match="shorter"):
        read_verified(storage, loc, np.empty(loc.length, np.uint8))


def test_a_bad_destination_is_refused_before_anything_is_read(tmp_path: Path, path: str) -> None:
    storage, locs, _ = _shard(tmp_path, [9_152])
    loc = locs[0]
    with pytest.raises(ValueError, match="smaller than the row"):
        read_verified(storage, loc, np.empty(loc.length - 1, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        read_verified(storage, loc, bytes(loc.length))
    with pytest.raises(ValueError):
        read_verified(storage, loc, np.empty((loc.length, 2), np.uint8)[:, 0])  # not contiguous


def test_a_sink_gets_each_segment_in_order_and_the_last_only_once_verified(tmp_path: Path, path: str) -> None:
    storage, locs, data = _shard(tmp_path, [2 * verified.SEGMENT + 5])
    loc = locs[0]
    out = np.empty(loc.length, np.uint8)
    seen: list[tuple[int, int]] = []

    def sink(a: int, b: int) -> None:
        assert np.array_equal(out[a:b], data[loc.offset + a : loc.offset + b])  # in place when handed on
        seen.append((a, b))

    read_verified(storage, loc, out, sink=sink)
    assert seen == [(0, verified.SEGMENT), (verified.SEGMENT, 2 * verified.SEGMENT), (2 * verified.SEGMENT, loc.length)]
    bad = data.copy()
    bad[loc.offset + loc.length - 1] ^= 1
    _rewrite(storage, bad)
    seen.clear()
    with pytest.raises(IntegrityError):
        read_verified(storage, loc, out, sink=sink)
    assert seen == [(0, verified.SEGMENT), (verified.SEGMENT, 2 * verified.SEGMENT)]  # the last never handed on


def test_threads_reading_at_once_each_get_their_own_row(tmp_path: Path, path: str) -> None:
    """Several callers at once: one holds the workers, the others read alone; no row mixes."""
    storage, locs, data = _shard(tmp_path, [4_129_792, 575_552, 9_152, 4_129_792 + 1])

    def reader(i: int) -> int:
        for _ in range(20):
            loc = locs[i % len(locs)]
            out = np.empty(loc.length, np.uint8)
            read_verified(storage, loc, out)
            assert np.array_equal(out, data[loc.offset : loc.offset + loc.length])
        return i

    with ThreadPoolExecutor(6) as pool:  # (map's results: a reader's failure is raised here)
        assert sorted(pool.map(reader, range(6))) == list(range(6))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_reads_large_rows(tmp_path: Path, path: str) -> None:
    """A child has none of the parent's reader threads; it still reads (and verifies) large rows."""
    storage, locs, data = _shard(tmp_path, [4_129_792 + 3])
    loc = locs[0]
    read_verified(storage, loc, np.empty(loc.length, np.uint8))  # the parent's workers are running
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child's exit status is the assertion)
        try:
            out = np.empty(loc.length, np.uint8)
            read_verified(storage, loc, out)
            os._exit(0 if np.array_equal(out, data[loc.offset : loc.offset + loc.length]) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_the_read_config_from_the_environment_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(verified.THREADS_ENV, "4")
    monkeypatch.setenv(verified.NATIVE_ENV, "0")
    assert ReadConfig.from_env() == ReadConfig(threads=4, native=False)
    monkeypatch.setenv(verified.THREADS_ENV, "lots")
    with pytest.raises(ValueError, match="MINT_READ_THREADS"):
        ReadConfig.from_env()
    monkeypatch.setenv(verified.THREADS_ENV, "2")
    monkeypatch.setenv(verified.NATIVE_ENV, "yes")
    with pytest.raises(ValueError, match="MINT_READ_NATIVE"):
        ReadConfig.from_env()
    with pytest.raises(ValueError, match="threads must be"):
        ReadConfig(threads=65)
    assert ReadConfig().n_threads >= 1


def test_without_a_compiler_rows_are_read_in_python_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from mint_store import native

    def no_compiler() -> None:
        raise native.BuildError("no C compiler found (set CC, or install gcc: apt-get install -y gcc)")

    monkeypatch.setattr(native_reader, "_load", no_compiler)
    with pytest.warns(UserWarning, match="rows are read in Python: no C compiler found"):
        assert native_reader._loaded.__wrapped__() is None  # (the cached reader of this process is untouched)


def test_the_reader_follows_the_latest_thread_count(tmp_path: Path) -> None:
    """configure(threads=n) sets the compiled reader's threads each time, also back to an earlier n."""
    if native_reader.reader(2) is None:
        pytest.skip("the compiled reader cannot be built here")
    storage, locs, data = _shard(tmp_path, [4_129_792 + 3])
    try:
        for n in (4, 1, 4, 2):
            configure(ReadConfig(threads=n))
            assert native_reader._threads == n
            out = np.empty(locs[0].length, np.uint8)
            read_verified(storage, locs[0], out)
            assert np.array_equal(out, data[locs[0].offset : locs[0].offset + locs[0].length])
    finally:
        configure(ReadConfig.from_env())


def test_a_location_whose_content_id_is_no_id_fails_as_a_mismatch(tmp_path: Path, path: str) -> None:
    import dataclasses

    storage, locs, _ = _shard(tmp_path, [9_152])
    bad = dataclasses.replace(locs[0], content_id="not-a-content-id")
    with pytest.raises(IntegrityError, match="does not match its content id"):
        read_verified(storage, bad, np.empty(bad.length, np.uint8))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_setaffinity and two CPUs")
def test_a_caller_pinned_to_one_cpu_reads_its_large_row_alone(tmp_path: Path) -> None:
    """vLLM's CPU worker pins itself to its CPUs: workers sharing the caller's one CPU would only
    take turns with it (measured: 3-5x slower), so such a row is read by the caller alone."""
    mod = native_reader.reader(2)
    if mod is None:
        pytest.skip("the compiled reader cannot be built here (no C compiler or Python headers)")
    configure(ReadConfig(threads=2))
    storage, locs, data = _shard(tmp_path, [4_129_792 + 3])
    loc = locs[0]

    def read(cpus: set[int] | None) -> int:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # (this pool thread only: affinity is per thread on Linux)
        out = np.empty(loc.length, np.uint8)
        read_verified(storage, loc, out)
        assert np.array_equal(out, data[loc.offset : loc.offset + loc.length])
        return int(mod.threads_used())

    try:
        cpus = sorted(os.sched_getaffinity(0))
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(read, None).result() == 2
        with ThreadPoolExecutor(1) as pool:
            assert pool.submit(read, {cpus[0]}).result() == 1
            assert pool.submit(read, set(cpus[:2])).result() == 2
    finally:
        configure(ReadConfig.from_env())


def test_a_mapped_shard_is_unmapped_when_it_is_deleted(tmp_path: Path) -> None:
    if native_reader.reader(2) is None:
        pytest.skip("the compiled reader cannot be built here (no C compiler or Python headers)")
    configure(ReadConfig(threads=2, mapped=True))
    try:
        storage, locs, data = _shard(tmp_path, [9_152])
        out = np.empty(locs[0].length, np.uint8)
        read_verified(storage, locs[0], out)
        assert np.array_equal(out, data[PAD:PAD + locs[0].length])
        assert storage._mappings == 1  # the small row came from the mapping
        storage.delete("packs/p")
        assert storage._mappings == 0
        with pytest.raises(BlobNotFound):
            read_verified(storage, locs[0], out)
    finally:
        configure(ReadConfig.from_env())


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "hash-then-copy"])
def test_copy_row_hashes_as_python_xxhash_does_at_every_edge(one_pass: bool) -> None:
    """copy_row's own XXH3 (hashing while it copies) against python-xxhash, which wrote the content
    ids: prefixes of 0 to 70 bytes (64 and up take the streaming path), lengths around the 240-byte
    edge of XXH3's long inputs, its 64-byte stripes and 1024-byte blocks, and random ones."""
    mod = native_reader.reader(2)
    if mod is None:
        pytest.skip("the compiled reader cannot be built here (no C compiler or Python headers)")
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 300_000, dtype=np.uint8)
    was = mod.set_one_pass(one_pass)
    try:
        cases = [(p, n) for p in (0, 1, 6, 32, 63, 64, 70) for n in (0, 1, 176, 177, 240 - p, 241 - p, 1024 - p,
                                                                   1025 - p, 1088 - p, 4097, 16_384 + 63)]
        cases += [(int(rng.integers(0, 71)), int(rng.integers(0, 200_000))) for _ in range(200)]
        for p, n in cases:
            n = max(n, 0)
            lid = "k" * p
            at = int(rng.integers(0, 64))  # any source alignment
            want = content_id(lid, src[at : at + n])
            out = np.zeros(n + 1, np.uint8)
            assert mod.copy_row(src, at, n, out, lid, want) == 0, (p, n)
            assert np.array_equal(out[:n], src[at : at + n]) and out[n] == 0, (p, n)
            assert mod.copy_row(src, at, n, out, lid, native_reader._wrong(want)) == 1, (p, n)
    finally:
        mod.set_one_pass(was)


_CUT_UNDER_THE_MAPPING = """
import mmap, os, sys
from pathlib import Path
import numpy as np
from mint_store.errors import BlobNotFound
from mint_store.read import ReadConfig, configure, read_verified
from tests.test_verified_reads import _shard

configure(ReadConfig(threads=2, mapped=True))
storage, locs, data = _shard(Path(sys.argv[1]), [9_152, 9_152, 9_152])
out = np.empty(9_152, np.uint8)
for loc in locs:
    read_verified(storage, loc, out)
assert storage._mappings == 1, "the small rows came from the shard's mapping"
path = storage.local_path("packs/p")
os.truncate(path, locs[1].offset + 100)  # in place, by another program, under the mapping
read_verified(storage, locs[0], out)  # wholly before the cut: read and verified as before
assert np.array_equal(out, data[locs[0].offset : locs[0].offset + 9_152])
for loc in locs[1:]:
    try:
        read_verified(storage, loc, out)
    except BlobNotFound as e:
        print("short:", e, flush=True)
    else:
        raise SystemExit("read a row the file no longer holds")
print("alive", flush=True)
f = open(path, "rb")
mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
os.truncate(path, 0)
mm[len(mm) - 1]  # a SIGBUS of no copy_row: the handler from before (the default) ends the process
print("survived a fault that was not copy_row's", flush=True)
"""


def test_a_mapped_shard_cut_short_by_another_program_fails_the_read_not_the_process(tmp_path: Path) -> None:
    """A shard truncated in place under its mapping (MinT never does; another program can) would end
    the process with SIGBUS on the first touch of a page past the cut: the compiled copy catches its
    own fault and the read fails as a short file does (BlobNotFound), while any other SIGBUS still
    goes to the handler that was there before (run in a child: without the guard it dies)."""
    import signal
    import subprocess
    import sys

    if native_reader.reader(2) is None:
        pytest.skip("the compiled reader cannot be built here (no C compiler or Python headers)")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONFAULTHANDLER", "MINT_READ_MMAP")}
    env["PYTHONPATH"] = str(root)
    proc = subprocess.run([sys.executable, "-c", _CUT_UNDER_THE_MAPPING, str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and lines[2] == "alive", (proc.returncode, proc.stdout, proc.stderr)
    assert all(line.startswith("short:") and "shorter than" in line for line in lines[:2]), lines
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr)
