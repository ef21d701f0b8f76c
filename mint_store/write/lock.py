"""The one-writer-process lock of an index directory."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import WriterLocked


class WriterLock:
    """An exclusive ``flock`` on ``<index>/writer.lock``; the file names the holder.

    flock is per open file description, so a second open in the same process conflicts
    too, which is what we want: one writer per index, full stop.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / "writer.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise WriterLocked(
                f"index {self.path.parent} is open for writing by {holder}; stop that process, or "
                "send writes through its server (--server URL), or open this store read-only"
            ) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv[:4], "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info.get('pid')} on {info.get('host')} ({' '.join(info.get('argv', []))})"
    except (OSError, ValueError):
        return "another process"
