"""The change feed's wake-up: long polls sleep until the store commits past their seq."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
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


@dataclass(slots=True)
class _Seen:
    visible: int  # seq of the last event the principal sees (0: none yet)
    checked: int  # every event up to this seq was checked: none after ``visible`` is visible


class VisibleHeads:
    """What the change feed shows a tenant token, without a figure about other tenants.

    A tenant's ``last_seq`` and ``head`` are seqs of events it sees, never the store's
    global seq (which counts every tenant's commits). Its cursor still advances: each
    answer's ``last_seq`` is its last visible event, and the server remembers, per
    principal (role and tenants), how far past that it has already checked the log, so the
    next poll resumes there instead of rescanning other tenants' events.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._seen: OrderedDict[Hashable, _Seen] = OrderedDict()
        self._capacity = capacity

    def start(self, key: Hashable, after: int) -> int:
        """Where a scan for events after ``after`` may begin (past what holds nothing visible)."""
        seen = self._seen.get(key)
        return max(after, seen.checked) if seen is not None and after >= seen.visible else after

    def note(self, key: Hashable, start: int, end: int, last_visible: int | None) -> None:
        """A scan of ``(start, end]`` found ``last_visible`` as its last visible event (None: none)."""
        seen = self._seen.get(key)
        if seen is not None and start <= seen.checked:
            if end > seen.checked:  # contiguous with what is known: extend it
                seen.visible, seen.checked = max(seen.visible, last_visible or 0), end
        elif last_visible is not None:  # nothing visible after it up to end, whatever came before
            seen = self._seen[key] = _Seen(last_visible, end)
        if seen is not None:
            self._seen.move_to_end(key)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)

    def known(self, key: Hashable) -> _Seen | None:
        return self._seen.get(key)

    def reset(self, key: Hashable, visible: int, checked: int) -> None:
        """A scan of the whole log up to ``checked`` found ``visible`` last."""
        self._seen[key] = _Seen(visible, checked)
        self._seen.move_to_end(key)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)


def scan_visible(events: Callable[..., list[dict[str, Any]]], who: Principal, after: int,
                 upto: int) -> tuple[int, int | None]:
    """``(checked, last visible seq or None)`` over the log after ``after`` up to ``upto``
    (blocking: pages of ``events``; runs on the executor)."""
    cursor, last = after, None
    while cursor < upto:
        page = events(cursor, limit=1000)
        if not page:
            break
        for ev in page:
            if visible(ev, who) is not None:
                last = int(ev["seq"])
        cursor = int(page[-1]["seq"])
    return cursor, last
