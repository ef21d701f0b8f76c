"""What handlers share: the store, a bounded executor for its blocking calls, auth, metrics."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from ..store import Store
from .auth import LOOPBACK_ADMIN, Principal, TokenTable
from .batching import ResolveBatcher
from .config import ServiceConfig
from .deadlines import write_outcome
from .feed import ChangeFeed
from .metrics import Metrics
from .rows.serving import RowSender
from .slots import ByteBudget, TenantSlots
from .tenant_feed import TenantSeqs

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class ServiceState:
    config: ServiceConfig
    store: Store
    executor: ThreadPoolExecutor
    tokens: TokenTable | None
    metrics: Metrics
    rows: RowSender
    feed: ChangeFeed
    uploads: asyncio.Semaphore
    resolver: ResolveBatcher
    tenant_slots: TenantSlots = field(default_factory=lambda: TenantSlots(4))
    tenant_seqs: TenantSeqs = field(default_factory=TenantSeqs)  # tenants' own numbering of the feed
    decode_budget: ByteBudget = field(default_factory=lambda: ByteBudget(2**30))
    started: float = field(default_factory=time.time)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """A blocking store call on the bounded executor, never on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, no_stop_iteration(functools.partial(fn, *args, **kwargs)))

    async def write(self, request: web.Request, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """A blocking store write (tag, untag, delete, a base) whose outcome is the answer: the
        request's deadline cannot answer 408 while it commits (:func:`.deadlines.write_outcome`)."""
        return await write_outcome(request, self.run(fn, *args, **kwargs), self.config.request_timeout)


def no_stop_iteration(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` with StopIteration turned into RuntimeError.

    asyncio cannot put a StopIteration into a Future (it raises TypeError in a callback
    instead), so one escaping from executor work left the awaiting request hanging until
    the request timeout. As a RuntimeError it is an ordinary 500 at once.
    """

    @functools.wraps(fn)
    def call() -> T:
        try:
            return fn()
        except StopIteration as e:
            raise RuntimeError(f"StopIteration escaped from {getattr(fn, '__name__', fn)!r}") from e

    return call


STATE = web.AppKey("mint_state", ServiceState)
CONFIG = web.AppKey("mint_config", ServiceConfig)
PRINCIPAL = web.RequestKey("mint_principal", Principal)


def state_of(request: web.Request) -> ServiceState:
    return request.app[STATE]


def principal_of(request: web.Request) -> Principal:
    return request.get(PRINCIPAL, LOOPBACK_ADMIN) if request.app[STATE].tokens is None else request[PRINCIPAL]
