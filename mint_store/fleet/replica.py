"""Read replicas: a local index built from the newest checkpoint plus the log after it, kept
current by following the log.

A local index directory is a cache of one store: the store's id (``store.id``, created
by the first writer) is stamped into the index, and an index stamped for another store --
or one whose last log object no longer exists (a recreated store, a compacted log) -- is
rebuilt, never trusted. Building: load the newest checkpoint that passes its checks
(older ones, then the whole log, if it does not), then replay the log after it.

Following: every ``follow_interval_s`` one LIST of ``log/`` after the last applied key (S3
``ListObjectsV2`` with ``StartAfter``; a local store's sorted names), then the new log
objects are applied in one index transaction. A writer on this machine that shares the
index directory keeps it current itself: the follower applies only while it holds the
index's writer lock (tried, never waited for). Objects in ``log/`` that are no log object
are skipped and counted (index/log_listing.py).

A gap (seq N+2 listed, N+1 not): the writer creates N+1, durably, before it plans N+2, so a
gap is never a commit in progress. Either the listing lags behind a create (some stores list
late: a GET of N+1 decides, and the log is read on by GETs), or N+1 is gone. When a
checkpoint covers N+1 the log was compacted past us: the index reloads from it, once. Else
the gap is waited on for ``GAP_POLLS`` polls and then reported (:class:`LogGap`; the replica
says ``log_gap``, fleet/replica_stats.py) while it goes on serving the index at N and looking,
every poll, for N+1 or a checkpoint past it -- never reloading an older checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import BlobNotFound, IntegrityError, LogGap, NotTheWriter, ObjectExists, WriterLocked
from ..index.checkpoint import CheckpointCorrupt, list_checkpoints, load_checkpoint
from ..index.commit_log import LOG_PREFIX, CommitLog, apply_event, log_key
from ..index.lmdb_index import INDEX_FORMAT, Index, dumps, index_db_path, loads
from ..index.log_listing import LIST_PAGE as _LIST_PAGE
from ..index.log_listing import LogListing, list_log_after
from ..storage import Storage
from ..write.lease import LEASE_KEY, describe
from ..write.lock import WriterLock
from .replica_stats import GAP_POLLS, ReplicaStats

log = logging.getLogger("mint.replica")

STORE_ID_KEY = "store.id"


# -- the store's identity and its writer ----------------------------------------------------


def read_store_id(storage: Storage) -> str | None:
    try:
        rec = json.loads(storage.get(STORE_ID_KEY))
    except BlobNotFound:
        return None
    except ValueError:
        raise IntegrityError(f"{STORE_ID_KEY} of {storage.url} is not valid JSON") from None
    sid = rec.get("id") if isinstance(rec, dict) else None
    if not isinstance(sid, str) or not sid:
        raise IntegrityError(f"{STORE_ID_KEY} of {storage.url} holds no store id")
    return sid


def require_store(url: str) -> None:
    """StoreNotFound unless a store lives at ``url`` (its ``store.id``, or a log from before
    it had one); creates nothing: a command that only reads or repairs must not turn a
    mistyped path into a new, empty, "clean" store."""
    from ..errors import StoreNotFound
    from ..storage import open_storage

    why = f"no store at {url}: check --store (or MINT_STORE); `mint publish` creates one"
    if "://" not in url or url.startswith("file://"):
        root = Path(url.removeprefix("file://"))
        if not ((root / STORE_ID_KEY).is_file() or (root / LOG_PREFIX).is_dir()):
            raise StoreNotFound(why)
        return
    storage = open_storage(url)
    try:
        if not (storage.exists(STORE_ID_KEY) or storage.list(LOG_PREFIX)):
            raise StoreNotFound(why)
    finally:
        storage.close()


def ensure_store_id(storage: Storage) -> str:
    """The store's id, created (create-only: two writers agree on one) if it has none."""
    sid = read_store_id(storage)
    if sid is not None:
        return sid
    try:
        storage.create(STORE_ID_KEY, json.dumps({"format": 1, "id": uuid.uuid4().hex, "created": time.time()}).encode())
    except ObjectExists:
        pass
    sid = read_store_id(storage)
    assert sid is not None
    return sid


def not_the_writer(storage: Storage) -> NotTheWriter:
    """The refusal of a write on a read-only store, naming the writer from its lease."""
    holder: dict[str, Any] = {}
    try:
        rec = json.loads(storage.get(LEASE_KEY))
        live = isinstance(rec, dict) and not rec.get("released") and float(rec.get("expires", 0)) > time.time()
        holder = (rec.get("holder") or {}) if live else {}
    except (BlobNotFound, ValueError, TypeError):
        pass
    url = holder.get("url") if isinstance(holder.get("url"), str) else None
    who = f"the writer ({describe(holder)})" if holder else "the writer (none holds the lease now)"
    fix = f"send writes to {url}" if url else "send writes to the service that holds the writer lease"
    return NotTheWriter(f"this store is open read-only (a replica); writes go to {who}: {fix}", writer_url=url)


# -- building and catching up --------------------------------------------------------------


def _meta(index: Index, key: bytes) -> Any:
    with index.read() as t:
        return loads(t.txn.get(key, db=t.dbs["meta"]))


def stamp_store_id(index: Index, store_id: str | None) -> None:
    if store_id is not None and _meta(index, b"store_id") != store_id:
        with index.write() as w:
            w.txn.put(b"store_id", dumps(store_id), db=w.dbs["meta"])


def load_newest_checkpoint(storage: Storage, index: Index, *, store_id: str | None, stats: ReplicaStats,
                           above: int = 0) -> bool:
    """Load the newest checkpoint that passes its checks into ``index`` (older ones after a
    rejected one, each rejection logged and kept in ``stats``). False when none is usable.

    ``above``: only checkpoints past that seq (a follower jumping a gap must never go back),
    and none ``stats`` saw rejected already (one bad checkpoint is not fetched every poll).
    """
    candidates = [s for s in list_checkpoints(storage) if s > above and not (above and s in stats.rejected_seqs)]
    if not above:
        stats.checkpoint_seq = None
    for seq in reversed(candidates):
        try:
            load_checkpoint(storage, seq, index, store_id=store_id)
        except CheckpointCorrupt as e:
            stats.rejected_checkpoints.append(f"{seq}: {e}")
            stats.rejected_seqs.add(seq)
            log.warning("index checkpoint %d of %s rejected (%s); trying an older one", seq, storage.url, e)
            continue
        stats.checkpoint_seq = seq
        return True
    return False


def empty_index(index: Index) -> None:
    """Drop every record of ``index`` (it is rebuilt from the whole log next)."""
    with index.write() as w:
        for db in w.dbs:
            w.txn.drop(w.dbs[db], delete=False)
        w.txn.put(b"format", dumps(INDEX_FORMAT), db=w.dbs["meta"])


def bootstrap(storage: Storage, index: Index, *, store_id: str | None, stats: ReplicaStats) -> int:
    """Rebuild ``index`` from the newest good checkpoint, then replay the log after it.
    Returns how many log objects were replayed. A gap in the log stops the replay there (the
    index is the prefix before it, as a lagging replica's is) and is noted in ``stats``."""
    if not load_newest_checkpoint(storage, index, store_id=store_id, stats=stats):
        log.info("no usable index checkpoint in %s: replaying the whole log", storage.url)
        empty_index(index)
    stamp_store_id(index, store_id)
    return _follow_step(storage, index, stats, store_id, report=False)


def catch_up(storage: Storage, index: Index, stats: ReplicaStats, *, page: int = _LIST_PAGE,
             listed: tuple[int, LogListing] | None = None) -> int:
    """One LIST after the index's position (or ``listed``: (position, listing) of one already
    made); apply what it names. Returns how many were applied.

    Raises LogGap when the next log object is gone (a GET confirms it) but later ones exist.
    """
    if listed is not None:
        last, listing = listed
    else:
        with index.read() as t:
            last = t.last_seq
        listing = list_log_after(storage, last, limit=page)
        stats.lists += 1
        stats.last_poll = time.time()
    stats.note_foreign(listing.foreign)
    stats.last_seq = last
    seqs = listing.seqs
    if not seqs:
        stats.clear_gap()
        return 0
    commit_log = CommitLog(storage)
    events: list[dict[str, Any] | None]
    if seqs[0] != last + 1:
        # N+1 is created before N+2 is planned: a listing without it lags, or N+1 is gone
        first = commit_log.read(last + 1)
        if first is None:
            raise LogGap(f"the log of {storage.url} has no object at seq {last + 1} ({log_key(last + 1)}) but "
                         f"continues at seq {seqs[0]}", after=last, next_seq=seqs[0])
        events = [first]  # the listing lagged: read on by GETs, one page at most
        while len(events) < page and (event := commit_log.read(last + 1 + len(events))) is not None:
            events.append(event)
        stats.log_objects_read += len(events)
    else:
        run = [s for i, s in enumerate(seqs) if s == last + 1 + i]
        with ThreadPoolExecutor(max_workers=8 if len(run) > 4 else 1, thread_name_prefix="mint-follow") as pool:
            events = list(pool.map(commit_log.read, run))
        stats.log_objects_read += len(run)
    stats.clear_gap()
    applied = 0
    with index.write() as w:
        if w.last_seq != last:  # someone else (a writer sharing this index) moved it: redo later
            return 0
        for event in events:
            if event is None:
                break  # vanished between the LIST and the GET (compaction): the next poll sees the gap
            apply_event(w, event)
            applied += 1
    stats.last_seq = last + applied
    return applied


# -- opening -------------------------------------------------------------------------------


def _try_lock(index_dir: str) -> WriterLock | None:
    lock = WriterLock(index_dir)
    try:
        lock.acquire()
    except WriterLocked:
        return None
    return lock


def _foreign(index: Index, store_id: str | None) -> str | None:
    stamped = _meta(index, b"store_id")
    if stamped is not None and store_id is not None and stamped != store_id:
        return f"it belongs to store {stamped}, not {store_id}"
    return None


def _needs_rebuild(storage: Storage, index: Index, store_id: str | None) -> str | None:
    if why := _foreign(index, store_id):
        return why
    with index.read() as t:
        last = t.last_seq
    if last > 0 and not storage.exists(log_key(last)):
        return f"the log no longer holds its last commit ({last}): the store was recreated or compacted"
    return None


def open_replica_index(storage: Storage, index_dir: str, *, stats: ReplicaStats) -> tuple[Index, bool]:
    """The index of a read-only store, built or brought up to date. Returns (index, follow).

    ``follow`` is False where this process may not write the index directory (then the
    index is opened as it is, as before: someone else keeps it current).
    """
    path = index_db_path(index_dir)
    parent = index_dir if os.path.isdir(index_dir) else os.path.dirname(os.path.abspath(index_dir))
    if not os.access(parent, os.W_OK) or (os.path.isdir(path) and not os.access(path, os.W_OK)):
        return Index.acquire(path, readonly=True), False
    lock = _try_lock(index_dir)
    if lock is None:  # a writer here holds this index and keeps it current
        return Index.acquire(path, readonly=True), True
    try:
        store_id = read_store_id(storage)
        fresh = not os.path.exists(os.path.join(path, "data.mdb"))
        if fresh and store_id is None and not list_log_after(storage, 0, limit=1) and not list_checkpoints(storage):
            raise FileNotFoundError(f"no index at {path}, and {storage.url} holds no store yet")
        # an index of another format (pickled records) raises IndexFormatMismatch here, as it
        # always did: a writable open rebuilds it (its records are never decoded)
        index = Index.acquire(path, readonly=not fresh)
        try:
            why = "it is new" if fresh else _needs_rebuild(storage, index, store_id)
            if why is None and index_is_empty(index):
                why = "it is empty"
            if why is not None:
                log.info("building the index of %s in %s (%s)", storage.url, index_dir, why)
                bootstrap(storage, index, store_id=store_id, stats=stats)
            else:
                stamp_store_id(index, store_id)
                _follow_step(storage, index, stats, store_id, report=False)  # a gap: noted, served as a prefix
        except BaseException:
            index.release()
            raise
        return index, True
    finally:
        lock.release()


def index_is_empty(index: Index) -> bool:
    with index.read() as t:
        return t.last_seq == 0


def _follow_step(storage: Storage, index: Index, stats: ReplicaStats, store_id: str | None,
                 listed: tuple[int, LogListing] | None = None, *, report: bool = True) -> int:
    """Catch up (all pages). A gap: reload from a checkpoint past it (the log was compacted),
    else note it, and once it outlasted ``GAP_POLLS`` polls raise it (with ``report``)."""
    total = 0
    while True:
        try:
            if listed is not None:
                total += catch_up(storage, index, stats, listed=listed)
                if not listed[1].full:
                    return total
                listed = None
            while n := catch_up(storage, index, stats):
                total += n
            return total
        except LogGap as gap:
            listed = None
            if _reload_past(storage, index, stats, store_id, gap):
                continue  # then the tail after that checkpoint (which may meet a later gap)
            polls = stats.note_gap(gap.after, gap.next_seq)
            if report and polls > GAP_POLLS:
                raise LogGap(f"{gap}; waited {polls} polls, and no checkpoint covers it: this replica serves "
                             f"the index at seq {gap.after} until the object is back (restore it from a backup) "
                             f"or the writer writes a checkpoint past it (every checkpoint_every commits, or "
                             f"Store.checkpoint() on the writer), which it reloads from", after=gap.after,
                             next_seq=gap.next_seq) from None
            if polls == 1:
                log.warning("%s; waiting for it (a store may answer late after a create)", gap)
            return total


def _reload_past(storage: Storage, index: Index, stats: ReplicaStats, store_id: str | None, gap: LogGap) -> bool:
    """Reload ``index`` from a checkpoint past the gap, if one loads: the log was compacted."""
    if not load_newest_checkpoint(storage, index, store_id=store_id, stats=stats, above=gap.after):
        return False
    log.warning("%s; reloaded the index from checkpoint %s, which covers it", gap, stats.checkpoint_seq)
    stats.reloads += 1
    stats.clear_gap()
    return True


def prepare_writer_index(storage: Storage, index: Index, stats: ReplicaStats | None = None) -> str:
    """For a writer (under its lease and index lock): the store id, and an index that is this
    store's, loaded from the newest checkpoint when it is empty (the caller replays the tail)."""
    store_id = ensure_store_id(storage)
    # only another store's index is rebuilt here: an index ahead of a damaged log is fsck's to report
    why = _foreign(index, store_id)
    if why is not None or index_is_empty(index):
        if why is not None:
            log.warning("the index is not this store's (%s): rebuilding it", why)
        if not load_newest_checkpoint(storage, index, store_id=store_id, stats=stats or ReplicaStats()) \
                and why is not None:
            empty_index(index)
    stamp_store_id(index, store_id)
    return store_id


# -- following -----------------------------------------------------------------------------


def poll_log(storage: Storage, index: Index, index_dir: str, stats: ReplicaStats) -> int:
    """One LIST; apply what it names (only while no writer here holds the index). Returns
    how many commits were applied. A failure (and a gap past ``GAP_POLLS`` polls: LogGap)
    raises and counts in ``stats.failures``; the first poll that succeeds clears them."""
    try:
        applied = _poll(storage, index, index_dir, stats)
    except Exception as e:
        stats.poll_failed(e)
        raise
    stats.poll_succeeded()
    return applied


def _poll(storage: Storage, index: Index, index_dir: str, stats: ReplicaStats) -> int:
    with index.read() as t:
        last = t.last_seq
    listing = list_log_after(storage, last)
    stats.lists += 1
    stats.last_poll = time.time()
    if not listing.seqs:
        stats.note_foreign(listing.foreign)
        stats.clear_gap()
        return 0
    lock = _try_lock(index_dir)
    if lock is None:
        return 0  # a writer on this index applies its own commits
    try:
        return _follow_step(storage, index, stats, _meta(index, b"store_id"), (last, listing))
    finally:
        lock.release()


class Follower:
    """A thread that polls the log every ``interval_s`` and applies new commits."""

    def __init__(self, storage: Storage, index: Index, index_dir: str, *, interval_s: float,
                 stats: ReplicaStats) -> None:
        self.storage, self.index, self.index_dir = storage, index, index_dir
        self.interval_s = interval_s
        self.stats = stats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mint-follow", daemon=True)
        self._thread.start()

    def poll_once(self) -> int:
        return poll_log(self.storage, self.index, self.index_dir, self.stats)

    def _run(self) -> None:
        failures = 0  # this thread's own, for the backoff (stats.failures counts every poller's)
        while not self._stop.wait(self.interval_s * min(2**failures, 20)):
            try:
                self.poll_once()
                failures = 0
            except Exception as e:  # an outage, a gap: must not stop following for good
                failures += 1
                log.warning("following the log of %s failed (%d in a row): %r", self.storage.url, failures, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
