"""Time limits that track progress rather than the clock: a request's body and its answer.

The middleware gives each request a whole-request deadline (``request_timeout``) for the
work the server does. A body that arrives slowly but steadily, or an answer that a slow
client reads steadily, is not the server's work: while bytes move, that deadline is paused
and each read (or write) instead gets ``read_timeout`` to make progress. A client that
stops sending gets 408 after ``read_timeout``, not after the whole-request deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from aiohttp import web

from ..errors import CommitInDoubt
from .errors import RequestTimeout

T = TypeVar("T")
DEADLINE = web.RequestKey("mint_deadline", asyncio.Timeout)


@contextmanager
def deadline_paused(request: web.Request, rearm: float | None) -> Iterator[None]:
    """Suspend the request's whole-request deadline; on exit it restarts with ``rearm`` s."""
    deadline = request.get(DEADLINE)
    if deadline is None or deadline.expired():
        yield
        return
    deadline.reschedule(None)
    try:
        yield
    finally:
        if rearm is not None:
            deadline.reschedule(asyncio.get_running_loop().time() + rearm)


async def within(step: Awaitable[T], seconds: float, what: str) -> T:
    """``await step``, or RequestTimeout when it makes no progress for ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            return await step
    except TimeoutError:
        raise RequestTimeout(f"no progress {what} for {seconds:g} s (read_timeout); "
                             "the connection is closed") from None


async def send_within(request: web.Request, step: Awaitable[T], seconds: float) -> T:
    """One write of a response body whose headers are out: a client that stops reading for
    ``seconds`` loses the connection (no error response is possible any more)."""
    try:
        return await within(step, seconds, "sending the response (the client stopped reading)")
    except RequestTimeout:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError("the client stopped reading the response") from None


async def write_outcome(request: web.Request, step: Awaitable[T], seconds: float) -> T:
    """``await step``, a write the store has begun (or is about to): its outcome is the answer.

    The whole-request deadline stops here: a 408 answered while the write goes on to commit
    tells a client that retries (408 is retryable) that nothing happened, and its resend makes
    a second version, or a second delete that finds its own first. ``step`` is never cancelled
    by the request; if it has not finished after ``seconds``, the answer is ``commit_in_doubt``
    (503, not retried by clients: look before sending it again).
    """
    deadline = request.get(DEADLINE)
    if deadline is not None and not deadline.expired():
        deadline.reschedule(None)
    task = asyncio.ensure_future(step)
    try:
        return await asyncio.wait_for(asyncio.shield(task), seconds)
    except TimeoutError:
        raise CommitInDoubt(f"the write did not finish within {seconds:g} s (request_timeout) and may still "
                            "be committed: look (versions, resolve) before sending it again") from None
