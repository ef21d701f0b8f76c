"""Peak memory of a benchmark, as the machine feels it.

``getrusage``'s peak RSS counts every page mapped into the process, page cache included: a
process that maps an 8 GB checkpoint (safetensors does) shows 8 GB more than it holds. What
other processes compete with is anonymous (and shared-anonymous) memory, so
:class:`MemoryWatch` samples ``RssAnon + RssShmem`` of this process from ``/proc`` in a
thread and keeps the peak. Linux only; elsewhere it reports None.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def anon_bytes(pid: int | str = "self") -> int | None:
    """``RssAnon + RssShmem`` of ``pid`` in bytes (None when /proc does not say)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    total = 0
    found = False
    for line in text.splitlines():
        if line.startswith(("RssAnon:", "RssShmem:")):
            total += int(line.split()[1]) * 1024
            found = True
    return total if found else None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def tree_anon_bytes(pid: int) -> int | None:
    """:func:`anon_bytes` summed over ``pid`` and its descendants."""
    total = anon_bytes(pid)
    if total is None:
        return None
    return total + sum(anon_bytes(c) or 0 for c in descendants(pid))


class MemoryWatch:
    """``with MemoryWatch() as w: ...``; then ``w.peak`` (bytes or None). One sample every
    ``interval`` seconds (a file read of microseconds: it does not disturb the timings);
    ``tree`` adds the process's descendants (a scan of /proc per sample: for child processes
    such as vLLM's workers)."""

    def __init__(self, interval: float = 0.25, *, tree: bool = False) -> None:
        self.interval = interval
        self.tree = tree
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memwatch", daemon=True)

    def sample(self) -> None:
        got = tree_anon_bytes(os.getpid()) if self.tree else anon_bytes()
        if got is not None and (self.peak is None or got > self.peak):
            self.peak = got

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> MemoryWatch:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
