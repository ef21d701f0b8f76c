"""The store: publish, tag, delete and read adapters over packs + log + index.

Writes go through one writer thread that group-commits whatever is queued: concurrent
publishes share one shard write per layout, one log object and one LMDB transaction.
Crash ordering for every write: writer lease checked -> shards durable (create-only,
new directories fsynced in their parents) -> lease checked again -> log object durable
(create-only: an existing ``log/<seq>.json`` fails the commit) -> index commit -> reply.
One writer per store: the ``writer.lease`` object in the store (see lease.py), whatever
the index directory.
Reads never touch the writer: one LMDB read transaction to resolve, one read call for
the bytes, one hash to verify.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from .config import StoreConfig, open_location
from .errors import (
    AdapterNotFound,
    InvalidAdapter,
    ReadOnlyStore,
    StoreClosed,
    StoreUnavailable,
)
from .fleet.replica import (
    Follower,
    ReplicaStats,
    not_the_writer,
    open_replica_index,
    poll_log,
    prepare_writer_index,
)
from .format.adapter import Adapter, check_base_shapes
from .format.hashing import content_id
from .format.layout import Layout, check_finite_rows
from .format.names import check_name, parse_ref
from .index.checkpoint import Checkpointer, collect_checkpoints
from .index.commit_log import CommitLog, apply_event
from .index.lmdb_index import Index, finish_swap, index_db_path
from .maintenance.reindex import open_writable_index
from .read.store_reads import StoreReads
from .results import PublishResult
from .storage import Storage
from .write.lease import LeaseWatch, WriterLease
from .write.lock import WriterLock
from .write.queue import PendingPublish, Sink, WriteOp
from .write.writer import Writer


def _plain_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``config`` as the log will hold it (JSON: string keys, lists): the index and every replica
    then hold the same record. A config JSON cannot hold is refused here, alone, instead of
    failing the whole group commit it would have joined."""
    if config is None:
        return None
    try:
        out = json.loads(json.dumps(config, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidAdapter(f"peft_config is not JSON ({e}): use lists (not sets), finite numbers, and plain "
                             "values (LoraConfig.to_dict() output: convert sets with list())") from None
    if not isinstance(out, dict):
        raise InvalidAdapter(f"peft_config must be a JSON object, not {type(config).__name__}")
    return out

class Store(StoreReads):
    """Open with :meth:`open`. Thread-safe; one writable Store per index across processes."""

    def __init__(self, storage: Storage, config: StoreConfig, index_dir: str, *,
                 fault_hook: Callable[[str], None] | None = None) -> None:
        self.storage = storage
        storage.retry = config.retry
        self.config = config
        self._fault_hook = fault_hook  # mint_store.testing.crash: the writer "crashes" at named points
        self.index_dir = index_dir
        self.log = CommitLog(storage)
        self._pid = os.getpid()
        self._lock: WriterLock | None = None
        self._lease: WriterLease | None = None
        self._lease_watch = LeaseWatch()  # what take-over attempts saw of the lease (a standby's polls)
        self._writer: Writer | None = None
        self._closed = False
        self._zstore: Any = None
        self._forked_index: Index | None = None
        self._upgrade = threading.Lock()
        self._checkpointer: Checkpointer | None = None
        self._follower: Follower | None = None
        self.replica_stats = ReplicaStats()
        if config.readonly:
            self._index, follow = open_replica_index(storage, index_dir, stats=self.replica_stats)
            self._start_following(follow)
            return
        self._become_writer(fresh=True)

    def _start_following(self, follow: bool = True) -> None:
        if follow and self.config.follow_interval_s > 0:
            self._follower = Follower(self.storage, self._index, self.index_dir,
                                      interval_s=self.config.follow_interval_s, stats=self.replica_stats)

    def _become_writer(self, *, fresh: bool, wait: bool = True) -> None:
        """Take the store's lease, then the index lock; replay the log tail; start the writer."""
        self.storage.check_conditional_writes()  # before anything: fencing rests on them
        with ExitStack() as undo:
            lease = WriterLease(self.storage, ttl_s=self.config.lease_ttl_s, renew_s=self.config.lease_renew_s,
                                watch=self._lease_watch)
            lease.acquire(wait=wait)
            undo.callback(lease.release)
            lock = WriterLock(self.index_dir)
            lock.acquire()
            undo.callback(lock.release)
            if fresh:
                finish_swap(self.index_dir)
            try:
                index = open_writable_index(self.storage, self.index_dir)
            except RuntimeError as e:  # opened read-only by lmdb in this process
                raise ReadOnlyStore(f"{e}; open the store writable from the start") from None
            undo.callback(index.release)
            store_id = prepare_writer_index(self.storage, index, self.replica_stats)
            self._replay(index)
            undo.pop_all()
        if not fresh:
            self._index.release()  # the same environment, now writable: keep one reference
        self._index, self._lock, self._lease = index, lock, lease
        self._writer = Writer(self.storage, index, self.log, self.config, lease, fault_hook=self._fault_hook)
        writer = self._writer
        self._checkpointer = Checkpointer(
            self.storage, index, store_id=store_id, every=self.config.checkpoint_every,
            interval_s=self.config.checkpoint_interval_s, enabled=lambda: writer.failed is None and lease.lost is None)
        writer.listeners.append(self._checkpointer.on_commit)

    def make_writable(self, *, wait: bool = True) -> None:
        """Take the writer role on a store opened read-only (raises WriterLocked if held).
        ``wait=False``: refuse a lease not yet seen unrenewed for its TTL (a standby's poll)."""
        with self._upgrade:
            if self._closed:
                raise StoreClosed("the store is closed")
            if self._pid != os.getpid():
                raise ReadOnlyStore("this store was opened by the parent process; open it again in this process")
            if self._writer is None:
                if self._follower is not None:  # it must not hold the index lock we take now
                    self._follower.stop()
                    self._follower = None
                try:
                    self._become_writer(fresh=False, wait=wait)
                except BaseException:
                    self._start_following()
                    raise

    def advertise(self, url: str) -> None:
        """Record in the writer lease the service URL that takes writes for this store."""
        if self._lease is not None:
            self._lease.advertise(url)

    @classmethod
    def open(cls, url: str | os.PathLike[str] = "./mint-data", **options: Any) -> Store:
        """Open a store at a directory, ``file://`` or ``s3://`` URL.

        Parameters
        ----------
        url
            A directory (created if missing), ``file://`` URL or fsspec URL (``s3://bucket/prefix``).
        **options
            :class:`~mint_store.config.StoreConfig` fields: ``readonly``, ``index_dir``,
            ``storage_options`` (fsspec/s3fs options), ``limits``, ``retry``, ...

        Returns
        -------
        Store
            Writable unless ``readonly=True``; close it (or use it as a context manager).

        Raises
        ------
        WriterLocked
            Another process holds the store's writer lease (its ``url`` names a serving
            ``mint serve``, if any); open with ``readonly=True`` to read meanwhile.
        TypeError, ValueError
            An unknown option or an invalid value of one.
        """
        config = StoreConfig(**options)
        storage, index_dir = open_location(url, config)
        return cls(storage, config, index_dir)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._follower is not None and self._pid == os.getpid():
            self._follower.stop()
        if self._writer is not None and self._pid == os.getpid():
            self._writer.stop()
        if self._checkpointer is not None and self._pid == os.getpid():
            self._checkpointer.close(final=True)
        if self._pid == os.getpid():
            self._index.release()
            if self._lock is not None:
                self._lock.release()
            if self._lease is not None:
                self._lease.release()
        self.storage.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writable(self) -> bool:
        return self._lock is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def health(self) -> dict[str, Any]:
        """``{"writable": bool, ...}``; a writer that cannot write says ``reason`` and ``since``."""
        if self._writer is None:
            # a replica: where it is in the log, what it was built from, its last poll
            return {"writable": False, "read_only": True, "replica": self.replica_stats.to_dict()}
        if self._writer.failed is not None or self._closed:
            return {"writable": False, "reason": f"the writer stopped: {self._writer.failed!r}"}
        lost = self._lease.lost if self._lease is not None else None
        if lost is not None:  # a renewal found the lease taken: the next write is refused
            return {"writable": False, "reason": lost}
        return self._writer.health.snapshot()

    def add_commit_listener(self, callback: Callable[[int], None]) -> None:
        """``callback(seq)`` runs on the writer thread after each index commit."""
        if self._writer is not None:
            self._writer.listeners.append(callback)

    def add_batch_listener(self, callback: Callable[[int], None]) -> None:
        """``callback(n)`` runs on the writer thread with the size of each publish group."""
        if self._writer is not None:
            self._writer.batch_listeners.append(callback)

    def add_rows_listener(self, callback: Callable[[list[tuple[str, int, int, str]]], None]) -> None:
        """``callback([(shard key, offset, length, content id), ...])`` runs on the writer thread
        once the shards of newly written rows exist (before their commit): each content id is
        the one the writer computed from the bytes it wrote there."""
        if self._writer is not None:
            self._writer.row_listeners.append(callback)

    @contextmanager
    def held_commits(self) -> Iterator[None]:
        """Queue writes without committing them until the block exits (forces one group)."""
        if self._writer is None:
            raise ReadOnlyStore("this store was opened read-only")
        self._writer.gate.clear()
        try:
            yield
        finally:
            self._writer.gate.set()

    def _idx(self) -> Index:
        if self._closed:
            raise StoreClosed("the store is closed")
        if self._pid != os.getpid():
            # never touch the parent's LMDB environment after fork: open our own, read-only
            forked = getattr(self, "_forked_index", None)
            if forked is None or forked.pid != os.getpid():
                forked = self._forked_index = Index.acquire(index_db_path(self.index_dir), readonly=True)
            return forked
        return self._index

    def _replay(self, index: Index) -> None:
        """Apply log objects that the index lacks (a crash between log write and commit, or
        commits of a writer that used another index directory)."""
        with index.read() as t:
            last = t.last_seq
        for event in self.log.after(last):
            with index.write() as w:
                apply_event(w, event)

    # -- writes ----------------------------------------------------------------------------

    def _submit(self, item: Any) -> None:
        if not self.writable:
            raise not_the_writer(self.storage)
        if self._pid != os.getpid():
            raise ReadOnlyStore("this store was opened by the parent process; open it again in this process")
        if self._closed:
            raise StoreClosed("the store is closed")
        if self._writer is None:
            raise ReadOnlyStore("this store was opened read-only; open it writable to change it")
        if self._writer.failed is not None:
            raise StoreClosed(f"the writer stopped after an error ({self._writer.failed!r}); reopen the store")
        if not self._writer.health.writable:
            raise StoreUnavailable(f"the store takes no writes for now ({self._writer.health.reason}); the writer "
                                   "is recovering by itself: retry later")
        self._writer.submit(item)

    def publish_async(
        self, tenant: str, name: str, adapter: Adapter, *, tag: str | None = None
    ) -> Future[PublishResult]:
        check_name(tenant, "tenant")
        check_name(name)
        if tag is not None:
            check_name(tag, "tag")
        layout, row = adapter.to_row()
        if layout.row_nbytes > self.config.limits.max_row_bytes:
            raise InvalidAdapter(f"row of {layout.row_nbytes} bytes is over the limit")
        sink = Sink(1, single=True)
        cid = content_id(layout.layout_id, row)
        config = _plain_config(adapter.peft_config)  # before anything is queued: refused alone
        self._submit([PendingPublish(tenant, name, layout, row, cid, tag, config, sink, 0)])
        return sink.future

    def publish(self, tenant: str, name: str, adapter: Adapter, *, tag: str | None = None) -> PublishResult:
        """Store ``adapter`` as the next version of ``tenant/name`` and wait until it is durable.

        Parameters
        ----------
        tenant, name
            Where it goes (``[a-z0-9][a-z0-9._-]{0,63}``).
        adapter
            The adapter, e.g. from :func:`~mint_store.peft.directory.load_peft_dir`.
        tag
            A tag to point at the new version in the same commit.

        Returns
        -------
        PublishResult
            Its version, content id, layout and the commit's seq; ``deduplicated`` when this
            tenant already held the same bytes (stored once).

        Raises
        ------
        InvalidName
            A tenant, name or tag outside the allowed spelling.
        InvalidAdapter
            NaN/Inf values, a row over the size limit, or (``BaseMismatch``) shapes that
            disagree with the registered base. Nothing is stored.
        ReadOnlyStore, StoreClosed, StoreUnavailable
            The store does not take writes (opened read-only, closed, or recovering).
        """
        return self.publish_async(tenant, name, adapter, tag=tag).result()

    def publish_many(
        self, items: Iterable[tuple[str, str, Adapter] | tuple[str, str, Adapter, str | None]]
    ) -> list[PublishResult]:
        futs = [self.publish_async(*it[:3], tag=it[3] if len(it) > 3 else None) for it in items]
        return [f.result() for f in futs]

    def publish_rows(
        self, names: Sequence[tuple[str, str]], layout: Layout, rows: np.ndarray, *, tag: str | None = None
    ) -> list[PublishResult]:
        """Bulk publish of pre-encoded rows ([N, S] uint8, e.g. from ``encode_rows``).

        All or nothing: one refused adapter refuses the whole call.
        """
        mixed = [m.name for m in layout.modules if m.a.dtype != m.b.dtype]
        if mixed:
            raise InvalidAdapter(f"module {mixed[0]!r}: lora_A and lora_B have different dtypes in this layout; store "
                                 "both in one dtype")
        rows = np.ascontiguousarray(rows, dtype=np.uint8).reshape(len(names), layout.row_nbytes)
        finite = check_finite_rows(layout, rows)
        if not finite.all():
            bad = int(np.flatnonzero(~finite)[0])
            raise InvalidAdapter(f"adapter {names[bad][0]}/{names[bad][1]} has NaN or Inf values")
        for tenant, name in names:
            check_name(tenant, "tenant")
            check_name(name)
        if tag is not None:
            check_name(tag, "tag")
        sink = Sink(len(names), single=False)
        lid = layout.layout_id
        bundle = [
            PendingPublish(tenant, name, layout, row, content_id(lid, row), tag, None, sink, i)
            for i, ((tenant, name), row) in enumerate(zip(names, rows, strict=True))
        ]
        if not bundle:
            return []
        self._submit(bundle)
        return list(sink.future.result())

    def _op(self, kind: str, **args: Any) -> Any:
        sink = Sink(1, single=True)
        self._submit(WriteOp(kind, args, sink))
        return sink.future.result()

    def tag(self, ref: str, tag: str) -> int:
        """Point ``tag`` at the version ``ref`` names (atomically). Returns the version."""
        r = parse_ref(ref)
        check_name(tag, "tag")
        if r.content_id is not None:
            raise AdapterNotFound("tags name versions of tenant/name, not content ids")
        return int(self._op("tag", ref=r, tag=tag))

    def untag(self, tenant: str, name: str, tag: str) -> None:
        self._op("untag", tenant=check_name(tenant, "tenant"), name=check_name(name), tag=check_name(tag, "tag"))

    def delete(self, ref: str) -> int:
        """Delete the version ``ref`` names (latest if none). Returns the version."""
        r = parse_ref(ref)
        if r.content_id is not None:
            raise AdapterNotFound("delete takes tenant/name[@version|:tag], not a content id")
        return int(self._op("delete", ref=r))

    # -- maintenance (library entry points are in compaction.py and fsck.py) ----------------

    def compact_shards(self, layout_id: str, shards: list[str], content_ids: list[str]) -> dict[str, Any]:
        """Rewrite the live rows of ``shards`` (rows ``content_ids``) into new shards, retire them."""
        return dict(self._op("compact", layout_id=layout_id, shards=list(shards), content_ids=list(content_ids)))

    def sweep(self, *, grace_s: float, now: float | None = None) -> list[str]:
        """Delete shards retired more than ``grace_s`` seconds ago; returns their keys."""
        swept = list(self._op("sweep", grace_s=float(grace_s), now=time.time() if now is None else float(now)))
        collect_checkpoints(self.storage, keep=self.config.checkpoint_keep)  # all but the newest K
        return swept

    def refresh(self) -> int:
        """A read-only store: apply the log's new commits now (a follower does so every
        ``follow_interval_s``). Returns how many were applied; 0 on the writer."""
        if self.writable:
            return 0
        return poll_log(self.storage, self._idx(), self.index_dir, self.replica_stats)

    def checkpoint(self) -> int:
        """Write an index checkpoint now (the writer does so every ``checkpoint_every`` commits);
        returns the seq it covers."""
        if self._checkpointer is None:
            raise ReadOnlyStore("only the writer writes checkpoints")
        return self._checkpointer.write_now()

    def quarantine(self, content_ids: list[str], *, recheck: bool = False) -> list[str]:
        """Mark rows damaged: their refs answer DamagedAdapter until the same bytes are republished.

        ``recheck``: only rows that still fail their content id where the index places them
        now (fsck's repair: a row its long scan read as damaged may have moved meanwhile).
        Returns the content ids marked.
        """
        return list(self._op("quarantine", content_ids=list(content_ids), recheck=recheck))

    def remove_orphans(self, keys: list[str]) -> list[str]:
        """Delete shard objects and temp files that no index entry names."""
        return list(self._op("remove_orphans", keys=list(keys)))

    def register_base(self, base: str, shapes: dict[str, Any]) -> None:
        """Record a base's module shapes; later publishes naming it are checked against them."""
        self._op("base", base=check_name(base, "base"), shapes=check_base_shapes(shapes))
