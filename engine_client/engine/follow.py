"""Following the store's change feed on the engine's I/O loop (hot swap).

For every event, the refs the engine has cached that the event may have moved (a tag, a
``latest``, a compacted location) are resolved again, their new rows are brought into
the host cache (so the swap itself costs one device copy), and the new locations are
*staged* in the :class:`~engine_client.engine.refs.RefTable`; the engine applies them when its
next batch starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

from mint_store import Location
from mint_store.errors import MintError

from ..stream.io_loop import IOThread
from ..stream.streamer import Streamer
from .refs import RefTable

log = logging.getLogger(__name__)


class FeedFollower:
    def __init__(self, client: Any, streamer: Streamer, refs: RefTable, io: IOThread, *, wait: float) -> None:
        self.client = client
        self.streamer = streamer
        self.refs = refs
        self._io = io
        self._wait = wait
        self._task: concurrent.futures.Future[None] | None = None
        self._seen = threading.Condition()
        self._seen_seq = 0
        self._failure: BaseException | None = None  # what ended the follower, when it ended on its own
        self._gen = 0  # the current task's number: an older task ending late changes nothing

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Read the feed's head, then follow it. If the head cannot be read (the service is
        down) this raises and nothing changes: moving refs are still resolved every batch."""
        if self.running:
            return
        self._task = None
        head = self._io.run(self._head())
        with self._seen:
            self._seen_seq = head
            self._failure = None
            self._gen += 1
            gen = self._gen
        # from here on moving refs are cached; a resolution that began before (it may predate
        # an event up to ``head``, which this follower will never see) is not
        self.refs.start_following()
        self._task = self._io.submit(self._run(head, gen))

    def stop(self) -> None:
        with self._seen:
            self._gen += 1  # a task still ending after this is no longer the follower's
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        self.refs.stop_following()  # (also after a follower that ended on its own error)

    def sync(self, timeout: float) -> int:
        """Wait until every event up to the feed's current head is staged; returns that seq."""
        if self._task is None:
            raise RuntimeError("the engine does not follow the change feed; call follow() first")
        if self._failure is not None:
            raise RuntimeError(f"following the change feed stopped: {self._failure!r}; call follow() again")
        head = self._io.run(self._head())
        with self._seen:
            if not self._seen.wait_for(lambda: self._seen_seq >= head or self._failure is not None, timeout):
                raise TimeoutError(f"the change feed did not reach seq {head} within {timeout} s")
        if self._failure is not None:
            raise RuntimeError(f"following the change feed stopped: {self._failure!r}; call follow() again")
        return head

    async def _head(self) -> int:
        return int((await self.client.events(0, limit=0)).head)

    async def _run(self, after: int, gen: int) -> None:
        try:
            async for event in self.client.follow(after, wait=self._wait):
                try:
                    await self._on_event(event)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one bad event must not stop hot swaps for good
                    log.exception("could not apply change-feed event %s", event.get("seq"))
                with self._seen:
                    self._seen_seq = int(event["seq"])
                    self._seen.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # terminal (a revoked token, a refused request): the feed is gone
            with self._seen:  # (start() and stop() change the generation under this lock)
                if gen != self._gen:  # stopped (and maybe started again) meanwhile: not the current follower's
                    return
                # cached moving refs would stay at their last version with nothing to move them:
                # forget them, so every batch resolves them again, as without the feed
                self.refs.stop_following()
                self._failure = e
                self._seen.notify_all()
            log.error("following the change feed stopped: %r; moving refs are resolved every batch "
                      "from now on (call follow() again to resume)", e)

    async def _on_event(self, event: dict[str, Any]) -> None:
        self.refs.begin_event()
        refs = self.refs.affected(event)
        if not refs:
            return
        try:
            got = await self.client.resolve_many(refs)
        except BaseException:
            # the refs this event moved cannot be re-resolved now: forget them (resolved again at
            # their next use) rather than keep serving the locations the event made stale
            for r in refs:
                self.refs.stage(r, None)
            raise
        fresh = [g for g in got if isinstance(g, Location)]
        if fresh:
            try:
                await self.streamer.prefetch(fresh)
            except MintError as e:
                log.warning("prefetch after event %s failed: %s", event.get("seq"), e)
        for r, g in zip(refs, got, strict=True):
            self.refs.stage(r, g if isinstance(g, Location) else None)
