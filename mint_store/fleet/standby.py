"""A standby writer: a read-only store that takes the writer lease when its holder stops renewing.

    standby = Standby(Store.open(url, readonly=True, index_dir=...) )   # see open_standby
    while not standby.step():          # every poll_s: one lease GET (+ a log probe)
        time.sleep(standby.poll_s)
    # standby.store is the writer now (epoch + 1), its index replayed to the log's head

While it waits, :func:`catch_up_index` keeps its local index at the log's head, so reads
served from it are current within one poll and the replay at take-over is short. The
take-over itself is :meth:`Store.make_writable`: a compare-and-swap of ``writer.lease``
(epoch + 1) that succeeds only once one version of the lease has stayed unrenewed for the
holder's TTL by this standby's own monotonic clock (or it released the lease, or its process
is gone on this host; wall clocks are never compared, see write/lease.py), then the log tail is
replayed before the writer thread starts, so no write is accepted on a stale index.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from ..config import StoreConfig, open_location
from ..errors import BlobNotFound, WriterLocked
from ..maintenance.reindex import open_writable_index
from ..storage import Storage
from ..store import Store
from ..write.lease import LEASE_KEY
from .replica import ReplicaStats, open_replica_index

log = logging.getLogger("mint.standby")


def catch_up_index(storage: Storage, index_dir: str) -> int:
    """Bring the local index in ``index_dir`` up to the head of the store's commit log.

    A new, empty, foreign or stale index is built from the store's newest index checkpoint
    and the log after it; a current one applies the log's new objects (one LIST). The one
    call to make before serving reads from a local index, or before taking the writer role.
    Returns the number of log objects read; 0 when another process writes this index
    directory (that writer keeps it current).
    """
    stats = ReplicaStats()
    try:
        index, _ = open_replica_index(storage, index_dir, stats=stats)
    except FileNotFoundError:  # nothing in the store yet: an empty index, the first writer fills it
        open_writable_index(storage, index_dir).release()
        return 0
    index.release()
    return stats.log_objects_read


def read_lease(storage: Storage) -> dict[str, Any] | None:
    """The ``writer.lease`` record, or None when no writer ever opened the store."""
    try:
        rec = json.loads(storage.get(LEASE_KEY))
    except (BlobNotFound, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


@dataclass(slots=True)
class WriterInfo:
    """Who holds the writer lease, as a standby last saw it."""

    url: str | None = None
    epoch: int | None = None
    host: str | None = None
    pid: int | None = None


def open_standby(url: str, **options: Any) -> Store:
    """A read-only store of ``url`` over its local index (``index_dir``, or the default one),
    created and caught up from the log first. ``options``: StoreConfig fields."""
    config = StoreConfig(**options)  # bad options fail before anything is created
    storage, index_dir = open_location(url, config)
    storage.retry = config.retry
    try:
        catch_up_index(storage, index_dir)
    finally:
        storage.close()
    return Store.open(url, **(options | {"readonly": True, "index_dir": index_dir}))


class Standby:
    """Drives one read-only :class:`Store` to the writer role. Not thread-safe: one caller."""

    def __init__(self, store: Store, *, poll_s: float | None = None) -> None:
        if store.writable:
            raise ValueError("a standby starts from a read-only store")
        self.store = store
        # a fraction of the lease TTL: the take-over follows the holder's expiry within one poll
        self.poll_s = poll_s if poll_s is not None else min(store.config.lease_renew_s,
                                                            store.config.lease_ttl_s / 4)
        self.writer = WriterInfo()
        self.took_over_at: float | None = None

    @property
    def active(self) -> bool:
        """True once this store holds the writer lease."""
        return self.store.writable

    def step(self) -> bool:
        """One poll: take the lease if it is free, else catch the index up. True: now the writer."""
        if self.store.writable:
            return True
        try:
            # lease CAS (epoch + 1), index lock, log tail replayed; never blocks: the store's lease
            # watch counts this poll toward the holder's TTL (judged by our monotonic clock only)
            self.store.make_writable(wait=False)
        except WriterLocked as e:
            self._note_holder(e.holder)
        else:
            self.took_over_at = time.time()
            lease = self.store._lease
            self.writer = WriterInfo(epoch=lease.epoch if lease is not None else None)
            log.info("took over the writer lease of %s (epoch %s)", self.store.storage.url, self.writer.epoch)
            return True
        applied = self.store.refresh()  # one LIST of the log (the store's follower polls too)
        if applied:
            log.debug("standby applied %d log objects", applied)
        return False

    def _note_holder(self, holder: dict[str, Any]) -> None:
        if not holder:
            return
        rec = read_lease(self.store.storage)
        url = holder.get("url")
        self.writer = WriterInfo(url=url if isinstance(url, str) and url else None,
                                 epoch=rec.get("epoch") if rec else None,
                                 host=holder.get("host") if isinstance(holder.get("host"), str) else None,
                                 pid=holder.get("pid") if isinstance(holder.get("pid"), int) else None)

    def run(self) -> Store:
        """Poll until this store is the writer (blocking); returns it."""
        while not self.step():
            time.sleep(self.poll_s)
        return self.store
