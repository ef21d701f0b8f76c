"""Resolves of concurrent requests, batched into one executor call and one read transaction.

Handing one tiny lookup to a thread costs more than the lookup (a queue, a thread wake-up,
a cross-thread callback). Under load many requests resolve at once: the ones that arrive
in the same event-loop turn share one executor job, which resolves them all in one LMDB
read transaction per owner filter and answers them with one cross-thread callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from concurrent.futures import Executor

from ..errors import MintError
from ..results import Location
from ..store import Store

_Pending = tuple[str, frozenset[str] | None, "asyncio.Future[Location]"]


class ResolveBatcher:
    def __init__(self, store: Store, executor: Executor, *, max_batch: int = 1024) -> None:
        self.store = store
        self.executor = executor
        self.max_batch = max_batch
        self._pending: list[_Pending] = []
        self._scheduled = False

    async def resolve(self, ref: str, owners: Collection[str] | None = None) -> Location:
        """``ref`` -> Location, or its typed error. ``owners``: see Store.resolve_many."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Location] = loop.create_future()
        self._pending.append((ref, None if owners is None else frozenset(owners), fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush, loop)
        return await fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        for i in range(0, len(batch), self.max_batch):
            part = batch[i : i + self.max_batch]
            job = loop.run_in_executor(self.executor, self._lookup, [(r, o) for r, o, _ in part])
            job.add_done_callback(lambda done, part=part: _answer(done, part))  # type: ignore[misc]

    def _lookup(self, items: list[tuple[str, frozenset[str] | None]]) -> list[Location | MintError]:
        groups: dict[frozenset[str] | None, list[int]] = {}
        for i, (_, owners) in enumerate(items):
            groups.setdefault(owners, []).append(i)
        out: list[Location | MintError] = [None] * len(items)  # type: ignore[list-item]
        for owners, idx in groups.items():
            for i, got in zip(idx, self.store.resolve_many([items[i][0] for i in idx], owners=owners), strict=True):
                out[i] = got
        return out


def _answer(done: asyncio.Future[list[Location | MintError]], part: list[_Pending]) -> None:
    exc = done.exception() if not done.cancelled() else asyncio.CancelledError()
    for i, (_, _, fut) in enumerate(part):
        if fut.done():  # the request went away
            continue
        if exc is not None:
            fut.set_exception(exc)
            continue
        got = done.result()[i]
        if isinstance(got, MintError):
            fut.set_exception(got)
        else:
            fut.set_result(got)
