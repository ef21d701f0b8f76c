"""``mint serve --standby``: serve reads, refuse writes naming the writer, take over when it stops.

The store opens read-only over this server's own index (caught up from the log first).
A background task polls the writer lease at a fraction of its TTL (see
:class:`mint_store.fleet.standby.Standby`): while the lease is held, it keeps the index at the
log's head (reads are current within one poll) and remembers the holder's URL; once one
version of the lease has stayed unrenewed for the holder's TTL by this server's monotonic
clock (wall clocks are never compared) it takes the lease over (epoch + 1), replays the log tail, and
only then is the store writable. Until then every write is refused with
:class:`~mint_store.errors.NotTheWriter` (405, the writer's URL in the body and in
``Location``), and ``/healthz`` says ``standby``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..errors import NotTheWriter, ReadOnlyStore
from ..fleet.standby import Standby

log = logging.getLogger("mint.service")


@dataclass(slots=True, eq=False)
class StandbyRole:
    """The standby's state as the handlers see it (one object, mutated by the lease task)."""

    standby: Standby | None = None  # set once the store is open
    url: str | None = None  # this server's URL, recorded in the lease once it is the writer
    took_over: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def waiting(self) -> bool:
        """Until the take-over is complete (the lease names this server): healthz says standby."""
        return not self.took_over.is_set()

    def refusal(self) -> NotTheWriter:
        writer = self.standby.writer if self.standby is not None else None
        url = writer.url if writer is not None else None
        where = (f"the writer is {url} (lease epoch {writer.epoch}): send writes there"
                 if writer is not None and url else
                 "no writer serves this store over HTTP right now (the lease holder advertised no URL)")
        return NotTheWriter(f"this server is a standby and takes no writes; {where}", writer_url=url)

    def health(self) -> dict[str, Any]:
        writer = self.standby.writer if self.standby is not None else None
        return {"status": "standby", "writable": False, "writer_url": writer.url if writer else None,
                "writer_epoch": writer.epoch if writer else None}


STANDBY = web.AppKey("mint_standby", StandbyRole)


def refuse_as_standby(app: web.Application, err: BaseException) -> BaseException:
    """``err`` as NotTheWriter when a standby refused a write (ReadOnlyStore) while it waits.

    Also the store's own NotTheWriter (its read-only open speaks as a replica): a client
    should learn that this server is a standby, which may become the writer."""
    role = app.get(STANDBY)
    if role is None or not role.waiting or not isinstance(err, ReadOnlyStore):
        return err
    return role.refusal()


async def follow_lease(role: StandbyRole, run: Callable[[Callable[[], bool]], Awaitable[bool]],
                       on_writer: Callable[[], Awaitable[None]]) -> None:
    """Poll the lease until this server is the writer, then ``await on_writer()`` once."""
    standby = role.standby
    if standby is None:
        raise RuntimeError("follow_lease before the store opened")
    failures = 0
    while True:
        step = asyncio.ensure_future(run(standby.step))
        try:
            became = await asyncio.shield(step)
            failures = 0
        except asyncio.CancelledError:
            # shutting down: let a take-over in flight finish, so that close() releases its lease
            await asyncio.wait([step])
            raise
        except Exception:  # a storage hiccup: the next poll tries again
            failures += 1
            log.warning("standby: polling the writer lease failed (%d in a row)", failures, exc_info=True)
            became = False
        if became:
            log.info("standby: this server is the writer now (lease epoch %s)", standby.writer.epoch)
            try:
                await on_writer()
            finally:
                role.took_over.set()  # the store is the writer whatever on_writer met
            return
        await asyncio.sleep(standby.poll_s * min(2**failures, 8))
