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


class ByteBudget:
    """At most ``capacity`` bytes admitted at once (one request alone always is): complete
    uploads decoded together, so their memory is bounded by bytes, not only by count.
    Waiters are served in order, so a large request is not passed over forever."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._cond = asyncio.Condition()
        self._queue: list[object] = []

    @property
    def waiting(self) -> int:
        """Holds asked for and not yet granted."""
        return len(self._queue)

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        ticket = object()
        async with self._cond:
            self._queue.append(ticket)
            try:
                await self._cond.wait_for(
                    lambda: self._queue[0] is ticket and (self.used == 0 or self.used + nbytes <= self.capacity))
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may fit now
            self.used += nbytes
        try:
            yield
        finally:
            async with self._cond:
                self.used -= nbytes
                self._cond.notify_all()
