"""The verified row read: the one path every reader of a row takes (the store's ``read_row``, the
engine's host cache, the service's row answers, the vLLM plugin, the trainer's loads).

A row is read into its destination in one pass over memory (DESIGN: a switch is one read,
one verify, one copy; the bound is one pass over the row's bytes):

* a local pack, a row under ``MAPPED_MAX``: copied from the shard's read-only mapping and
  hashed as it is copied, each 64-byte stripe loaded once (no system call; the kernel's copy is
  slow into a destination aligned unlike the row's file offset, as most rows of a shard are; a
  file another program cut short under the mapping fails the read as a short file does, the
  copy catching its own SIGBUS);
* a local pack, a larger row: chunks of a few hundred KiB ``pread`` straight into the destination, each
  hashed (xxh3-128 streaming) while it is still in cache; a large row's chunks are read by
  several threads while the caller hashes them in order (:mod:`.native`, compiled on first
  use; without it the same chunks on one thread in Python);
* an object store: the storage's own read (concurrent ranged GETs for a large row), then the
  hash;
* ``sink`` (for a device copy overlapped with the read): called with ``(start, stop)`` for
  each segment of the destination as it is read and verified so far, in order; the row as a
  whole is only good once the call returns.

The content id is ``xxh3_128(layout_id + row)`` (:mod:`mint_store.format.hashing`), so a
mismatch anywhere in the row fails the read (:class:`~mint_store.errors.IntegrityError`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import BlobNotFound, IntegrityError
from ..format.hashing import content_hasher
from ..results import Location
from ..storage import LocalStorage, Storage
from . import native
from .buffers import row_buffer

CHUNK = 256 * 1024  # the Python path's chunk: a few of them fit in L2 next to the hasher
SEGMENT = 8 << 20  # with a sink: the destination is handed on in segments this large
THREADS_ENV, NATIVE_ENV, MMAP_ENV = "MINT_READ_THREADS", "MINT_READ_NATIVE", "MINT_READ_MMAP"
# rows below this are copied from the shard's mapping (compiled ``copy_row``): no system call,
# and a copy that any alignment suits. Larger ones: ``preadv`` by several threads, which on their
# first read (page faults, not paid by preadv) outrun a mapped copy from about 1 MiB
MAPPED_MAX = 1 << 20


@dataclass(frozen=True, slots=True)
class ReadConfig:
    """How rows are read: ``threads`` readers per large row (the caller and ``threads - 1``
    workers; default: the CPUs this process may run on, at most 8), whether the compiled
    reader is used (``native``), and whether rows under ``MAPPED_MAX`` of a local shard are
    copied from its read-only mapping (``mapped``)."""

    threads: int = 0
    native: bool = True
    mapped: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.threads <= 64:
            raise ValueError(f"threads must be 1 to 64 (0: one per CPU, at most 8), got {self.threads}")

    @classmethod
    def from_env(cls) -> ReadConfig:
        """From ``MINT_READ_THREADS`` (an integer, 1 to 64) and ``MINT_READ_NATIVE`` (``0``: read in Python)."""
        raw = os.environ.get(THREADS_ENV, "0").strip() or "0"
        if not raw.isdigit():
            raise ValueError(f"{THREADS_ENV}={raw!r} is not a number of threads (1 to 64)")
        flag = os.environ.get(NATIVE_ENV, "1").strip()
        if flag not in ("0", "1", ""):
            raise ValueError(f"{NATIVE_ENV}={flag!r}: use 1 (the compiled reader, the default) or 0 (Python)")
        mapped = os.environ.get(MMAP_ENV, "1").strip()
        if mapped not in ("0", "1", ""):
            raise ValueError(f"{MMAP_ENV}={mapped!r}: use 1 (small rows from mapped shards, the default) or 0 "
                             "(preadv only)")
        return cls(threads=int(raw), native=flag != "0", mapped=mapped != "0")

    @property
    def n_threads(self) -> int:
        return self.threads or max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                            else os.cpu_count() or 1))


_UNSET: Any = object()
_module: Any = _UNSET  # the compiled reader, None (read in Python), or not chosen yet
_mapped = True  # small rows of a local shard from its mapping (ReadConfig.mapped)


def configure(config: ReadConfig) -> None:
    """Read rows this way from now on (process-wide: the compiled reader's threads are shared)."""
    global _module, _mapped
    _module = native.reader(config.n_threads) if config.native else None
    _mapped = config.mapped


def _reader() -> Any:
    if _module is _UNSET:
        configure(ReadConfig.from_env())
    return _module


def read_verified(storage: Storage, loc: Location, out: Any, *, verify: bool = True,
                  sink: Callable[[int, int], None] | None = None) -> None:
    """Fill the first ``loc.length`` bytes of ``out`` with the row of ``loc``, checked against
    its content id.

    Parameters
    ----------
    storage
        The store's storage (the row is ``loc.length`` bytes at ``loc.offset`` of ``loc.shard_key``).
    loc
        From ``resolve``.
    out
        The destination: any writable, C-contiguous buffer of at least ``loc.length`` bytes
        (a numpy array, a memoryview, a CPU tensor's ``numpy()``).
    verify
        Hash the bytes as they are read and compare with ``loc.content_id``.
    sink
        Called with ``(start, stop)`` as each segment of ``view`` is in place, in order.

    Raises
    ------
    ValueError
        ``out`` is read-only, not C-contiguous, or smaller than the row.
    BlobNotFound
        The shard is gone or shorter than the row (the caller resolves again).
    IntegrityError
        The bytes do not match the content id; run ``mint fsck``.
    """
    if isinstance(storage, LocalStorage):
        e = storage.hold(loc.shard_key)
        try:
            mod = _module if _module is not _UNSET else _reader()
            mapped = (storage.mapping(e) if _mapped and sink is None and mod is not None
                      and loc.length < MAPPED_MAX else None)
            if mapped is None:
                read_fd(e.fd, loc, out, verify=verify, sink=sink)
                return
            try:  # a row that fits in cache: hashed and copied from the mapped page cache (one call)
                rc = mod.copy_row(mapped, loc.offset, loc.length, out, loc.layout_id,
                                  loc.content_id if verify else None)
            except ValueError:
                _refused(loc, out)
            _raise_for(loc, rc)
        finally:
            storage.release(e)
        return
    view = row_buffer(loc.length, out)[1]
    storage.read_into(loc.shard_key, loc.offset, view)  # (S3: concurrent ranged GETs for a large row)
    if verify:
        check = RowCheck(loc)
        check.update(view)
        check.done()
    if sink is not None:
        sink(0, loc.length)


def read_fd(fd: int, loc: Location, out: Any, *, verify: bool = True,
            sink: Callable[[int, int], None] | None = None) -> None:
    """:func:`read_verified` from an open file: the row is ``loc.length`` bytes at ``loc.offset``
    of ``fd`` (a shard, or a row cache's file of one row at offset 0). BlobNotFound if the
    file ends first."""
    n = loc.length
    mod = _module if _module is not _UNSET else _reader()
    if sink is None and mod is not None:  # the hot path: one call, the GIL released
        try:
            rc = mod.read_row(fd, loc.offset, n, out, loc.layout_id, loc.content_id if verify else None)
        except ValueError:
            _refused(loc, out)
        _raise_for(loc, rc)
        return
    view = row_buffer(n, out)[1]
    check = RowCheck(loc) if verify else None
    step = SEGMENT if sink is not None else max(n, 1)
    for s0 in range(0, n, step):
        s1 = min(n, s0 + step)
        if mod is not None and check is None:
            if mod.read_row(fd, loc.offset + s0, s1 - s0, view[s0:s1], loc.layout_id, None) == 2:
                raise _short(loc)
        else:
            for c0 in range(s0, s1, CHUNK):
                chunk = view[c0 : min(s1, c0 + CHUNK)]
                _pread_full(fd, chunk, loc.offset + c0, loc)
                if check is not None:
                    check.update(chunk)  # while it is in cache
        if check is not None and s1 == n:
            check.done()  # before the last segment is handed on
        if sink is not None:
            sink(s0, s1)
    if check is not None and n == 0:
        check.done()


def _raise_for(loc: Location, rc: int) -> None:
    """What a compiled read's answer means: 0 the row is in place, 1 a mismatch, 2 the file ended first."""
    if rc == 1:
        raise _mismatch(loc)
    if rc == 2:
        raise _short(loc)


def _refused(loc: Location, out: Any) -> NoReturn:
    """Why the compiled reader refused a call: ``out`` (its own ValueError, as on the Python
    path), else the location's content id is no id (a damaged index: a mismatch)."""
    row_buffer(loc.length, out)
    raise _mismatch(loc) from None


def hash_fd(fd: int, loc: Location) -> None:
    """Check the row at ``loc`` in ``fd`` without keeping it (a row sent by ``sendfile``):
    chunks through one small buffer, each hashed while in cache. IntegrityError on a mismatch,
    BlobNotFound if the file ends first."""
    check = RowCheck(loc)
    buf = memoryview(bytearray(min(CHUNK, loc.length)))
    for c0 in range(0, loc.length, CHUNK):
        chunk = buf[: min(CHUNK, loc.length - c0)]
        _pread_full(fd, chunk, loc.offset + c0, loc)
        check.update(chunk)
    check.done()


class RowCheck:
    """A row's content id checked as its bytes arrive, in order (a file's chunks, an HTTP
    body's pieces): ``update`` each, then ``done`` raises IntegrityError on a mismatch."""

    __slots__ = ("_h", "_loc", "_n")

    def __init__(self, loc: Location) -> None:
        self._loc, self._h, self._n = loc, content_hasher(loc.layout_id), 0

    def update(self, chunk: Any) -> None:
        self._h.update(chunk)
        self._n += memoryview(chunk).nbytes

    def matches(self) -> bool:
        """Whether the bytes so far are the whole row of the content id."""
        return self._n == self._loc.length and self._h.hexdigest() == self._loc.content_id

    def done(self) -> None:
        if not self.matches():
            raise _mismatch(self._loc)


def _short(loc: Location) -> BlobNotFound:
    return BlobNotFound(f"object {loc.shard_key!r} is shorter than {loc.offset + loc.length} bytes")


def _pread_full(fd: int, buf: memoryview, offset: int, loc: Location) -> None:
    got = os.preadv(fd, [buf], offset)
    while got < len(buf):  # short reads are legal; only a read of nothing means the end
        k = os.preadv(fd, [buf[got:]], offset + got)
        if k == 0:
            raise _short(loc)
        got += k


def _mismatch(loc: Location) -> IntegrityError:
    return IntegrityError(
        f"row of content id {loc.content_id} in shard {loc.shard_key} at offset {loc.offset} does not "
        "match its content id; run `mint fsck`"
    )
