"""Fair shares of the upload pipeline: a few uploads per tenant at once, then a global slot.

An upload first takes one of its tenant's ``tenant_uploads`` places and receives its body
(spooled to a temp file, each read under ``read_timeout``). Only a complete body takes one
of the ``upload_slots`` that bound decoding and committing (and the memory they use). A
tenant whose clients trickle their bodies therefore holds its own places only: other
tenants' uploads neither wait behind it for a place nor for a slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Share:
    sem: asyncio.Semaphore
    users: int = 0  # holders and waiters: the share is dropped when none is left
    active: int = 0  # holders


@dataclass(slots=True)
class TenantSlots:
    """At most ``per_tenant`` uploads of one tenant in progress; more of that tenant wait (FIFO)."""

    per_tenant: int
    _shares: dict[str, _Share] = field(default_factory=dict)

    @asynccontextmanager
    async def hold(self, tenant: str) -> AsyncIterator[None]:
        share = self._shares.get(tenant)
        if share is None:
            share = self._shares[tenant] = _Share(asyncio.Semaphore(self.per_tenant))
        share.users += 1
        try:
            async with share.sem:
                share.active += 1
                try:
                    yield
                finally:
                    share.active -= 1
        finally:
            share.users -= 1
            if share.users == 0:  # no entry per tenant name ever seen: the map stays small
                del self._shares[tenant]

    def active(self, tenant: str) -> int:
        """Uploads of ``tenant`` holding a place now."""
        share = self._shares.get(tenant)
        return share.active if share is not None else 0

    def total_active(self) -> int:
        return sum(s.active for s in self._shares.values())


@dataclass(slots=True, eq=False)
class _Wait:
    owner: str
    nbytes: int


class ByteBudget:
    """At most ``capacity`` bytes admitted at once (one request alone always is), in order of
    asking, so a large request (up to ``capacity - share``) is not passed over forever.

    ``share``: the bytes one owner (a caller) may hold as it likes. Past it, an owner's
    requests are admitted only while a share of the budget stays free (``used + n <=
    capacity - share``), and one waiting for that does not block the line: the others'
    requests are admitted past it. So however slowly a tenant's clients read, holding their
    buffers, another tenant's requests up to a share always fit (its first request, like any
    owner's first, is admitted once the budget has room for it).

    A request larger than ``capacity - share`` (a whole adapter's export, say) is admitted only
    into an empty budget, and waiting for it holds up nobody (it could not be admitted beside a
    slow reader's bytes however long the others waited): under steady traffic it may wait until
    its request times out. While it is held, the other owners' requests still get one share
    between them, and a request that cannot fit in that share waits without holding them up. So
    however slowly one caller's clients read, the others are not shut out, and the budget holds
    at most ``capacity + share`` (or the oversize request alone, when larger).
    """

    def __init__(self, capacity: int, share: int | None = None) -> None:
        self.capacity = capacity
        self.share = capacity if share is None else share
        self.used = 0
        self._big = 0  # bytes held by oversize requests (admitted alone; see _oversize)
        self._held: dict[str, int] = {}  # owner -> bytes held now (owners holding nothing are absent)
        self._queue: list[_Wait] = []
        self._next: _Wait | None = None  # the request admitted next: recomputed at every change
        self._cond = asyncio.Condition()

    @property
    def waiting(self) -> int:
        """Holds asked for and not yet granted."""
        return len(self._queue)

    def held(self, owner: str) -> int:
        """Bytes ``owner`` holds now."""
        return self._held.get(owner, 0)

    def _oversize(self, nbytes: int) -> bool:
        """A request that cannot be admitted while a share stays free: it is admitted alone."""
        return self.share < self.capacity and nbytes > self.capacity - self.share

    def _in_share(self, w: _Wait) -> bool:
        if self.share >= self.capacity:  # no share of its own: strictly in order
            return True
        if self._oversize(w.nbytes):  # waiting for an empty budget, it holds up nobody's request
            return self.used == 0
        held = self._held.get(w.owner, 0)
        return held == 0 or held + w.nbytes <= self.share or self.used + w.nbytes <= self.capacity - self.share

    def _changed(self) -> None:
        """Pick the next request (the first in line whose owner is within its share, and not behind
        one of its own owner's that is not: a caller's small requests never pass its own large
        one, which would then wait for as long as the caller keeps reading) and wake the line."""
        blocked: set[str] = set()
        self._next = None
        for w in self._queue:
            if w.owner in blocked:
                continue
            if self._big and (self._oversize(w.nbytes) or self.used - self._big + w.nbytes > self.share):
                # cannot be admitted beside the oversize request held now: it waits without
                # holding up the requests that can (the others' one share)
                blocked.add(w.owner)
                continue
            if self._in_share(w):
                self._next = w
                break
            blocked.add(w.owner)
        self._cond.notify_all()

    def _fits(self, w: _Wait) -> bool:
        if self._next is not w:
            return False
        if self.used == 0:
            return True
        if self._big:  # an oversize request holds most of the budget: the others still get one share
            return self.used - self._big + w.nbytes <= self.share
        return self.used + w.nbytes <= self.capacity

    @asynccontextmanager
    async def hold(self, nbytes: int, owner: str = "") -> AsyncIterator[None]:
        w = _Wait(owner, nbytes)
        async with self._cond:
            self._queue.append(w)
            self._changed()
            try:
                await self._cond.wait_for(lambda: self._fits(w))
            finally:
                self._queue.remove(w)
                self._changed()  # the next in line may fit now (or, cancelled, it never held)
            self.used += nbytes
            big = nbytes if self._oversize(nbytes) else 0
            self._big += big
            self._held[owner] = self._held.get(owner, 0) + nbytes
            self._changed()
        try:
            yield
        finally:
            async with self._cond:
                self.used -= nbytes
                self._big -= big
                left = self._held[owner] - nbytes
                if left:
                    self._held[owner] = left
                else:
                    del self._held[owner]
                self._changed()
