"""The change feed's wake-up: long polls sleep until the store commits past their seq."""

from __future__ import annotations

import asyncio
from typing import Any

from .auth import Principal


class ChangeFeed:
    """Tracks the last committed seq on the event loop; the writer thread reports commits."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seq: int) -> None:
        self._loop = loop
        self.seq = seq
        self.closed = False
        self._waiters: set[asyncio.Future[None]] = set()

    @property
    def parked(self) -> int:
        """Long polls asleep in :meth:`wait_beyond` right now (what tests synchronize on)."""
        return len(self._waiters)

    def on_commit(self, seq: int) -> None:
        """Called on the store's writer thread after each commit."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.advance, seq)

    def advance(self, seq: int) -> None:
        """The store has committed up to ``seq`` (on the loop); long polls wake only if it moved
        (a replica reports its head every 0.2 s: each report woke every parked poll for nothing)."""
        if seq > self.seq:
            self.seq = seq
            self._wake()

    def _wake(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def close(self) -> None:
        """Shutdown: every long poll returns now with what it has."""
        self.closed = True
        self._wake()

    async def wait_beyond(self, seq: int, timeout: float) -> None:
        """Return once a commit past ``seq`` happened, the feed closed, or ``timeout`` passed."""
        if self.seq > seq or self.closed or timeout <= 0:
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.add(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(fut)


def visible(event: dict[str, Any], who: Principal) -> dict[str, Any] | None:
    """The part of an event ``who`` may see (None: nothing).

    Tenants see their own publishes, tags and deletes, and base registrations (bases are
    shared). Compaction moves name content ids of every tenant: admins only (HTTP
    clients fetch by content id, so a move never leaves them holding a stale location).
    """
    if who.is_admin:
        return event
    kind = event.get("kind")
    if kind == "publish":
        items = [i for i in event.get("items", []) if who.holds(i.get("tenant", ""))]
        return {**event, "items": items} if items else None
    if kind in ("tag", "untag", "delete"):
        return event if who.holds(event.get("tenant") or "") else None
    if kind == "base":
        return event
    return None
