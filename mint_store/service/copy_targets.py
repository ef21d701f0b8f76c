"""The callers' memory the local copy server writes rows into, mapped once and kept.

Writing a row through a memfd's file interface (``sendfile``, ``pwrite``) goes through shmem's
write path page by page: on the 2-core VM of ``tools/bench_vllm.py`` a 37 MB row took
6.2-8 ms that way, a ``pread`` of it into a mapping of the same memfd, already populated,
4.0-4.2 ms. A vLLM worker reuses its row buffers (:mod:`engine_client.vllm_plugin.buffers`)
and sends the same memfd again, so after the first copy into a memfd (through its file
interface, which allocates its pages without zeroing them) the server maps it (2.9 ms here,
after the caller has its row), keyed by the memfd's inode, and reads each next row into that.

Mapping a caller's file is safe only if it cannot shrink under the mapping: a store past its
end is a SIGBUS, which would kill the service. So only memfds sealed against shrinking
(``F_SEAL_SHRINK``) are mapped; anything else (a regular file, an unsealed memfd) is written
through its file interface, which cannot fault. The seal is also the caller's word that the
buffer will be sent again (the plugin seals only the buffers it pools).

A kept mapping holds its pages after the caller freed them, so mappings are kept within
``keep_bytes`` in all (least recently used out first), none unused for more than ``idle_s``,
and none once no connection is open.

A caller can also send a buffer before any row is copied into it (:meth:`CopyTargets.prepare`):
the plugin's pool makes its next buffer ahead, off the load's path, and shows it to the service
then, so even the first row copied into it is a ``pread`` into a mapping, not the file interface's
write path (the 4.0-4.2 ms against 6.2-8 ms above).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import threading
import time
from collections import OrderedDict

MIN_MAPPED = 1 << 20  # smaller rows: through the file interface (mapping them saves nothing)


class Mapped:
    """A writable shared mapping of a caller's sealed memfd (``size`` bytes from its start)."""

    __slots__ = ("key", "mm", "size", "used")

    def __init__(self, key: tuple[int, int], fd: int, size: int) -> None:
        # populated here, on the service's CPU: the copy then faults nothing
        self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.key, self.size, self.used = key, size, 0.0

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # (a view still held: unmapped when it goes)
            self.mm.close()


class CopyTargets:
    """Kept mappings of the memfds callers sent: ``take`` one for a copy and ``give_back`` it
    after; a memfd not mapped yet is copied into through its file interface, then ``keep`` it.

    Parameters
    ----------
    keep_bytes
        Most bytes of callers' memory kept mapped between copies (0: none kept).
    idle_s
        A mapping unused this long is dropped.
    """

    def __init__(self, keep_bytes: int, idle_s: float = 30.0) -> None:
        if keep_bytes < 0 or idle_s <= 0:
            raise ValueError("keep_bytes must be >= 0 and idle_s positive")
        self.keep_bytes, self.idle_s = keep_bytes, idle_s
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[int, int], Mapped] = OrderedDict()  # least recently used first
        self.mapped = 0  # mappings made (tests and logs)
        self.reused = 0  # copies into a mapping kept from an earlier one
        self.prepared = 0  # of the mappings, those made before any copy (prepare: a caller's spare)

    def take(self, fd: int, length: int) -> Mapped | None:
        """The mapping kept of ``fd`` if it holds ``length`` bytes, to copy into; None: write
        through the file interface (not mapped yet, not a sealed memfd, or a small row)."""
        found = _mappable(fd, length)
        if found is None:
            return None
        with self._lock:
            drop = self._sweep(time.monotonic())
            got = self._kept.pop(found[0], None)
            if got is not None and got.size < length:
                drop.append(got)  # (the memfd grew: mapped again, whole, by keep)
                got = None
            elif got is not None:
                self.reused += 1
        for d in drop:
            d.close()
        return got

    def keep(self, fd: int, length: int) -> bool:
        """After a copy of ``length`` bytes into ``fd`` through its file interface: map it for the
        next (populated now, when the copy has allocated its pages: mapping a new memfd first
        would zero every page that the copy then overwrites). Whether it is kept."""
        found = _mappable(fd, length)
        if found is None or found[1] > self.keep_bytes:
            return False
        try:
            m = Mapped(found[0], fd, found[1])  # (sealed: its size only grows, the mapping stays valid)
        except (OSError, ValueError):  # (no memory for it now, sealed against writes, or empty: the file interface)
            return False
        with self._lock:
            self.mapped += 1
        self.give_back(m)
        return True

    def prepare(self, fd: int) -> bool:
        """A caller's buffer its next row will be copied into, mapped before that copy (a spare
        whose pages the caller has already touched), so that the copy is a ``pread`` into it
        too. Whether it is kept: a sealed memfd of at least ``MIN_MAPPED`` bytes, within
        ``keep_bytes``, every page of it allocated (no hole: populating the mapping then
        allocates nothing, so no caller can make the service fill memory for it)."""
        found = _mappable(fd, MIN_MAPPED)
        if found is None or found[1] < MIN_MAPPED or not _allocated(fd, found[1]):
            return False
        with self._lock:
            if found[0] in self._kept and self._kept[found[0]].size >= found[1]:
                return True  # (mapped already)
        if not self.keep(fd, found[1]):
            return False
        with self._lock:
            self.prepared += 1
        return True

    def give_back(self, m: Mapped) -> None:
        """Keep ``m`` for the next copy into the same memory (within the bounds)."""
        m.used = time.monotonic()
        with self._lock:
            old = self._kept.pop(m.key, None)  # (two copies into one memfd at once: the newer stays)
            drop = [old] if old is not None else []
            self._kept[m.key] = m
            while self.kept_bytes > self.keep_bytes:
                drop.append(self._kept.popitem(last=False)[1])
            drop += self._sweep(m.used)
        for d in drop:
            d.close()

    def clear(self) -> None:
        """Drop every kept mapping (no caller is connected)."""
        with self._lock:
            drop, self._kept = list(self._kept.values()), OrderedDict()
        for d in drop:
            d.close()

    @property
    def kept_bytes(self) -> int:
        return sum(m.size for m in self._kept.values())  # (a few buffers per worker: no running sum)

    def _sweep(self, now: float) -> list[Mapped]:
        """Under the lock: take out the mappings unused for ``idle_s`` (closed by the caller)."""
        out = []
        while self._kept and now - next(iter(self._kept.values())).used >= self.idle_s:
            out.append(self._kept.popitem(last=False)[1])
        return out


def _mappable(fd: int, length: int) -> tuple[tuple[int, int], int] | None:
    """``((device, inode), size)`` of ``fd`` if a copy of ``length`` bytes into it goes through
    a mapping: a memfd sealed against shrinking, and a row large enough to gain from it."""
    if length < MIN_MAPPED or not _cannot_shrink(fd):
        return None
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino), st.st_size


def _allocated(fd: int, size: int) -> bool:
    """Whether every page of ``fd``'s first ``size`` bytes is allocated (its first hole is at its end)."""
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) >= size
    except (OSError, AttributeError):  # (no SEEK_HOLE here: not known, so not mapped ahead)
        return False


def _cannot_shrink(fd: int) -> bool:
    """Whether ``fd`` is a memfd sealed against shrinking (any other file: EINVAL)."""
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except (OSError, AttributeError):  # (not a memfd; or no seals on this system)
        return False
