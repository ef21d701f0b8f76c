"""One connection per calling thread, each closed by :meth:`ThreadConnections.close` (the row readers')."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar


class _Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


class ThreadConnections(Generic[C]):
    """The calling thread's connection, made by ``connect`` when it has none."""

    def __init__(self, connect: Callable[[], C]) -> None:
        self._connect = connect
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: set[C] = set()

    @property
    def held(self) -> bool:
        """Whether this thread has a connection already (kept from an earlier call)."""
        return getattr(self._local, "conn", None) is not None

    def get(self) -> C:
        conn: C | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            with self._lock:
                self._all.add(conn)
        return conn

    def drop(self) -> None:
        """Close this thread's connection (its next call opens a new one)."""
        conn: C | None = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._lock:
                self._all.discard(conn)
            conn.close()

    def close(self) -> None:
        """Close every thread's connection (a thread that calls again opens a new one)."""
        with self._lock:
            conns, self._all = self._all, set()
        for conn in conns:
            conn.close()

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[C]:
        """Every thread's open connection, as of now."""
        with self._lock:
            return iter(list(self._all))
