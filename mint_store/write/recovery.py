"""How the writer comes back after a failed commit, and what it tells ``/healthz`` meanwhile.

A failed commit (disk full, permissions, an S3 outage past the storage layer's retries)
fails only the publishes of that commit. The writer then recovers in place: it checks that
the storage takes a write again (a probe object, written and deleted) and replays the log
objects the index lacks (a commit whose log object reached storage before the failure is
durable, so it is applied). Shard objects that no log object names stay orphans, for
``fsck --repair`` and ``sweep``. Until a recovery succeeds, writes fail fast with
:class:`~mint_store.errors.StoreUnavailable` and the health says why.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import StoreConfig
from ..errors import CommitConflict, CommitInDoubt, MintError, StoreClosed, StoreUnavailable, WriterFenced
from ..index.commit_log import CommitLog, apply_event
from ..index.lmdb_index import Index
from ..storage import Storage
from .queue import STOP, fail_item

log = logging.getLogger("mint.writer")

PROBE_KEY = "writer-probe"


class WriterHealth:
    """The writer's state as the service reports it. Updated on the writer thread only."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.writable = True
        self.reason: str | None = None
        self.since: float | None = None
        self.failures = 0
        self.recoveries = 0

    def degrade(self, reason: str) -> None:
        with self._cond:
            if self.writable:
                self.since = time.time()
                self.failures += 1
            self.writable = False
            self.reason = reason

    def recovered(self) -> None:
        with self._cond:
            if not self.writable:
                self.recoveries += 1
            self.writable, self.reason, self.since = True, None, None
            self._cond.notify_all()

    def wait_writable(self, timeout: float | None = None) -> bool:
        """Block until the writer is writable (True) or ``timeout`` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.writable, timeout)

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            out: dict[str, Any] = {"writable": self.writable, "failures": self.failures,
                                   "recoveries": self.recoveries}
            if not self.writable:
                out.update(reason=self.reason, since=self.since)
            return out


def recover(storage: Storage, index: Index, commit_log: CommitLog, notify: Callable[[int], None]) -> list[int]:
    """One recovery attempt: probe a write, then replay what the log holds past the index.

    Returns the replayed seqs (each is reported to ``notify``); raises when the storage
    still refuses writes or the log cannot be applied.
    """
    storage.put(PROBE_KEY, b"mint writer probe\n")
    storage.delete(PROBE_KEY)
    return replay(index, commit_log, notify)


def replay(index: Index, commit_log: CommitLog, notify: Callable[[int], None]) -> list[int]:
    """Apply what the log holds past the index, each seq reported to ``notify``; returns them."""
    with index.read() as t:
        last = t.last_seq
    replayed: list[int] = []
    for event in commit_log.after(last):
        with index.write() as w:
            apply_event(w, event)
        replayed.append(int(event["seq"]))
    for seq in replayed:
        notify(seq)
    return replayed


class WriterRecovery:
    """The recovery half of :class:`~mint_store.write.writer.Writer` (runs on the writer thread)."""

    storage: Storage
    index: Index
    log: CommitLog
    config: StoreConfig
    queue: queue.Queue[Any]
    health: WriterHealth
    _packs: dict[str, Any]
    _zstore: Any
    _probe_shards: bool
    _inflight: tuple[int, Callable[[], None] | None, dict[str, Any]] | None  # seq, answer, event
    lease: Any

    def _notify(self, seq: int) -> None:
        raise NotImplementedError

    def _fail_queued(self, err: BaseException) -> None:
        raise NotImplementedError

    def _unavailable(self, cause: BaseException | None = None) -> StoreUnavailable:
        why = repr(cause) if cause is not None else self.health.reason
        return StoreUnavailable(f"the storage refused a write ({why}); nothing was committed. The writer is "
                                "recovering by itself: retry later (GET /healthz says when it is writable)")

    def _after_failure(self, e: Exception, sinks: list[Any]) -> None:
        """Fail the commit that raised ``e`` (unless replay shows it durable) and recover once."""
        inflight, self._inflight = self._inflight, None
        log.error("commit failed: %r; recovering the writer", e, exc_info=e)
        self.health.degrade(f"a commit failed: {e!r}")
        self._packs.clear()  # reopen packs from storage: a failed resize may have left them stale
        self._zstore = None
        durable = taken = doubt = False
        if self._try_recover() and inflight is not None:
            with self.index.read() as t:
                landed = t.last_seq >= inflight[0]
            # the object at that seq may be another writer's: the late commit of the writer before
            # us, landed while our create failed with another error (a 503, a timeout)
            ours = self._logged(inflight[0], inflight[2]) if landed else None
            durable, taken, doubt = ours is True, ours is False, landed and ours is None
        if taken and inflight is not None:
            log.warning("log seq %s holds another writer's commit; ours was not logged", inflight[0])
            err0 = CommitConflict(f"log seq {inflight[0]} holds another writer's commit (ours failed with {e!r}); "
                                  "nothing of this request was committed: send it again")
            err0.__cause__ = e
            for sink in sinks:
                sink.fail(err0)
            return
        if durable and inflight is not None:
            if inflight[1] is not None:
                inflight[1]()  # its log object reached storage before the failure: it is committed
                return
            err: StoreUnavailable = StoreUnavailable(
                f"commit {inflight[0]} is durable (recovery applied it) but the operation stopped after {e!r}; "
                "run it again")
            err.__cause__ = e
            for sink in sinks:
                sink.fail(err)
            return
        err = self._unavailable(e)
        if inflight is not None and (doubt or (not durable and not self.health.writable)):
            err = CommitInDoubt(f"the storage failed ({e!r}) while commit {inflight[0]} was being logged, and "
                                "whether it landed is not known: if it did, the writer applies it when it "
                                "recovers. Do not send it again blindly: once the store is writable (GET "
                                "/healthz), look at the versions first")
        err.__cause__ = e
        for sink in sinks:
            sink.fail(err)

    def _logged(self, seq: int, event: dict[str, Any]) -> bool | None:
        """Whether the log object at ``seq`` is ``event`` (as its JSON reads back); None when it
        cannot be read now (then the commit is in doubt: neither answered nor denied)."""
        try:
            return self.log.read(seq) == json.loads(json.dumps(event))
        except Exception as e:
            log.warning("could not read back log seq %s: %r", seq, e)
            return None

    def _past_orphan_shard(self, e: CommitConflict) -> bool:
        """A new shard's name was taken while this writer still holds the lease: the writer before
        it, paused past its lease, wrote shards before its commit was fenced (orphans, for fsck).
        The packs reopen from storage and, until a commit lands, look for taken shard names
        before planning (the stored shape may be our own failed resize, smaller than theirs).
        False when the lease is gone (then this writer is the one fenced)."""
        if self.lease is None:
            return False
        try:
            self.lease.check()
        except WriterFenced:
            return False
        log.warning("%s while holding the lease: the previous writer's orphan; planning past it", e)
        self._packs.clear()
        self._zstore = None
        self._probe_shards = True  # reopened packs look for every taken name, not only this one
        return True

    def _caught_up_after_conflict(self, e: CommitConflict, sinks: list[Any]) -> bool:
        """Our log object's seq was taken. True when this writer still holds the lease: then the
        object is a commit the writer before us had in flight when it lost the lease, landing after
        our take-over's replay (create-only decided: it is the commit at that seq, valid against the
        state it was planned on, as ours no longer is). It and what follows are applied, only this
        commit fails (nothing of it reached the log; the caller sends it again) and the writer
        goes on. False when the lease is gone: this writer is the one fenced."""
        if self.lease is None or self._inflight is None:
            return False  # no lease, or a shard name taken (not a log seq): the caller's error stands
        try:
            self.lease.check()
        except WriterFenced:
            return False
        inflight, self._inflight = self._inflight, None
        seq = inflight[0] if inflight is not None else None
        log.warning("log seq %s was taken by a late commit of the previous writer; applying it", seq)
        self._packs.clear()  # shards of the failed commit are orphans; packs reopen from storage
        self._zstore = None
        if not self._try_recover():
            err: MintError = self._unavailable(e)
        else:
            err = CommitConflict(f"{e} -- it is a commit of the writer before this one (in flight when it lost "
                                 "the lease), applied now; nothing of this request was committed: send it again")
        err.__cause__ = e
        for sink in sinks:
            sink.fail(err)
        return True

    def _try_recover(self) -> bool:
        try:
            recover(self.storage, self.index, self.log, self._notify)
        except Exception as e:
            self.health.degrade(f"recovery failed: {e!r}")
            log.warning("writer recovery failed: %r", e)
            return False
        self.health.recovered()
        log.info("the writer recovered; writes are accepted again")
        return True

    def _recover_until_stopped(self) -> bool:
        """Retry recovery with backoff, failing writes fast meanwhile. False: the store closed."""
        attempt = 0
        while True:
            deadline = time.monotonic() + self.config.retry.delay(min(attempt, 30))
            while (left := deadline - time.monotonic()) > 0:
                try:
                    item = self.queue.get(timeout=left)
                except queue.Empty:
                    break
                if item is STOP:
                    self._fail_queued(StoreClosed("the store closed while its storage refused writes"))
                    return False
                fail_item(item, self._unavailable())
            if self._try_recover():
                return True
            attempt += 1

