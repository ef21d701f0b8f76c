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

import hashlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .adapter import Adapter, AdapterLimits, check_base_shapes
from .checkpoint import Checkpointer, collect_checkpoints
from .errors import (
    AdapterNotFound,
    BaseNotFound,
    BlobNotFound,
    IntegrityError,
    InvalidAdapter,
    LayoutNotFound,
    MintError,
    ReadOnlyStore,
    StaleLocation,
    StoreClosed,
    StoreUnavailable,
)
from .hashing import content_id
from .index import Index, Txn, finish_swap, index_db_path, seq_key
from .layout import Layout, check_finite_rows
from .lease import WriterLease
from .lock import WriterLock
from .log import CommitLog, apply_event
from .names import Ref, check_name, parse_ref, parse_ref_cached
from .packs import SHARD_TARGET_BYTES, read_row_with_zarr
from .queries import owned_by, resolve_in, version_record
from .records import Location, PublishResult, VersionInfo
from .reindex import open_writable_index
from .replica import (
    Follower,
    ReplicaStats,
    not_the_writer,
    open_replica_index,
    poll_log,
    prepare_writer_index,
)
from .retry import RetryPolicy
from .storage import LocalStorage, Storage, open_storage
from .writer import Writer, _Op, _Pending, _Sink

# fault-injection points, in commit order (tests "crash" at each and reopen)
CRASH_POINTS = ("after_resize", "after_shards", "after_log", "after_index")


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    index_dir: str | None = None
    readonly: bool = False
    storage_options: dict[str, Any] | None = None
    shard_target_bytes: int = SHARD_TARGET_BYTES
    max_batch: int = 8192
    max_batch_bytes: int = 1 << 30
    limits: AdapterLimits = field(default_factory=AdapterLimits)
    crash_at: frozenset[str] = frozenset()
    lease_ttl_s: float = 10.0  # a writer that stops renewing is taken over after this
    lease_renew_s: float = 3.0
    # transient storage errors (S3 5xx/SlowDown, resets, EINTR); also the writer's recovery backoff
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # index checkpoints (checkpoint.py): every N commits or T seconds, and at a clean close
    checkpoint_every: int = 1000
    checkpoint_interval_s: float = 600.0  # at 10^6 adapters a checkpoint is ~600 MB: not every minute
    checkpoint_keep: int = 3  # `sweep` deletes older ones
    follow_interval_s: float = 0.2  # a read-only store polls the log this often (0: never)

    def __post_init__(self) -> None:
        unknown = set(self.crash_at) - set(CRASH_POINTS)
        if unknown:
            raise ValueError(f"unknown crash points {sorted(unknown)}; known: {CRASH_POINTS}")
        if self.shard_target_bytes < 1 or self.max_batch < 1:
            raise ValueError("shard_target_bytes and max_batch must be positive")
        if not 0 < self.lease_renew_s < self.lease_ttl_s:
            raise ValueError("lease_renew_s must be positive and shorter than lease_ttl_s")
        if self.checkpoint_every < 1 or self.checkpoint_interval_s <= 0 or self.checkpoint_keep < 1:
            raise ValueError("checkpoint_every, checkpoint_interval_s and checkpoint_keep must be positive")
        if self.follow_interval_s < 0:
            raise ValueError("follow_interval_s must be >= 0 (0: do not follow the log)")


def default_index_dir(url: str) -> str:
    """``<store>/index`` for a local store; a per-URL directory under ~/.cache otherwise."""
    if "://" not in url or url.startswith("file://"):
        return str(Path(url.removeprefix("file://")) / "index")
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    base = os.environ.get("MINT_INDEX_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "mint-store")
    return os.path.join(base, digest)




class Store:
    """Open with :meth:`open`. Thread-safe; one writable Store per index across processes."""

    def __init__(self, storage: Storage, config: StoreConfig, index_dir: str) -> None:
        self.storage = storage
        storage.retry = config.retry
        self.config = config
        self.index_dir = index_dir
        self.log = CommitLog(storage)
        self._pid = os.getpid()
        self._lock: WriterLock | None = None
        self._lease: WriterLease | None = None
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

    def _become_writer(self, *, fresh: bool) -> None:
        """Take the store's lease, then the index lock; replay the log tail; start the writer."""
        with ExitStack() as undo:
            lease = WriterLease(self.storage, ttl_s=self.config.lease_ttl_s, renew_s=self.config.lease_renew_s)
            lease.acquire()
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
        self._writer = Writer(self.storage, index, self.log, self.config, lease)
        writer = self._writer
        self._checkpointer = Checkpointer(
            self.storage, index, store_id=store_id, every=self.config.checkpoint_every,
            interval_s=self.config.checkpoint_interval_s, enabled=lambda: writer.failed is None and lease.lost is None)
        writer.listeners.append(self._checkpointer.on_commit)

    def make_writable(self) -> None:
        """Take the writer role on a store opened read-only (raises WriterLocked if held)."""
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
                    self._become_writer(fresh=False)
                except BaseException:
                    self._start_following()
                    raise

    def advertise(self, url: str) -> None:
        """Record in the writer lease the service URL that takes writes for this store."""
        if self._lease is not None:
            self._lease.advertise(url)

    @classmethod
    def open(cls, url: str | os.PathLike[str] = "./mint-data", **options: Any) -> Store:
        """Open a store at a directory, ``file://`` or ``s3://`` URL. Options: StoreConfig fields."""
        config = StoreConfig(**options)
        text = os.fspath(url)
        storage = open_storage(text, storage_options=config.storage_options)
        # the storage's own URL: memory://b/p and memory://b/p/ share one default index
        index_dir = config.index_dir or default_index_dir(
            str(storage.root) if isinstance(storage, LocalStorage) else storage.url
        )
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
        return self._writer.health.snapshot()

    def add_commit_listener(self, callback: Callable[[int], None]) -> None:
        """``callback(seq)`` runs on the writer thread after each index commit."""
        if self._writer is not None:
            self._writer.listeners.append(callback)

    def add_batch_listener(self, callback: Callable[[int], None]) -> None:
        """``callback(n)`` runs on the writer thread with the size of each publish group."""
        if self._writer is not None:
            self._writer.batch_listeners.append(callback)

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
        sink = _Sink(1, single=True)
        cid = content_id(layout.layout_id, row)
        self._submit([_Pending(tenant, name, layout, row, cid, tag, adapter.peft_config, sink, 0)])
        return sink.future

    def publish(self, tenant: str, name: str, adapter: Adapter, *, tag: str | None = None) -> PublishResult:
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
        sink = _Sink(len(names), single=False)
        lid = layout.layout_id
        bundle = [
            _Pending(tenant, name, layout, row, content_id(lid, row), tag, None, sink, i)
            for i, ((tenant, name), row) in enumerate(zip(names, rows, strict=True))
        ]
        if not bundle:
            return []
        self._submit(bundle)
        return list(sink.future.result())

    def _op(self, kind: str, **args: Any) -> Any:
        sink = _Sink(1, single=True)
        self._submit(_Op(kind, args, sink))
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

    def compact(self, **policy: Any) -> Any:
        """Run compaction with a :class:`~mint_store.compaction.CompactionPolicy` built from ``policy``."""
        from .compaction import CompactionPolicy, compact

        return compact(self, CompactionPolicy(**policy))

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

    def quarantine(self, content_ids: list[str]) -> list[str]:
        """Mark rows damaged: their refs answer DamagedAdapter until the same bytes are republished."""
        return list(self._op("quarantine", content_ids=list(content_ids)))

    def remove_orphans(self, keys: list[str]) -> list[str]:
        """Delete shard objects and temp files that no index entry names."""
        return list(self._op("remove_orphans", keys=list(keys)))

    def register_base(self, base: str, shapes: dict[str, Any]) -> None:
        """Record a base's module shapes; later publishes naming it are checked against them."""
        self._op("base", base=check_name(base, "base"), shapes=check_base_shapes(shapes))

    # -- the writer thread -------------------------------------------------------------------

    def resolve(self, ref: str | Ref) -> Location:
        """ref -> location, in one read transaction (the hot path: no context managers)."""
        r = parse_ref_cached(ref) if isinstance(ref, str) else ref
        index = self._idx()
        txn = index.env.begin()
        try:
            return resolve_in(Txn(txn, index.dbs), r)
        finally:
            txn.abort()

    def resolve_many(
        self, refs: Sequence[str | Ref], *, owners: Collection[str] | None = None
    ) -> list[Location | MintError]:
        """Many refs in one read transaction; a failed ref yields its error in place.

        With ``owners``, a ``sha:`` ref resolves only when a live version of one of those
        tenants holds it (BlobNotFound otherwise): the service's tenant isolation.
        """
        out: list[Location | MintError] = []
        index = self._idx()
        txn = index.env.begin()  # as in resolve: an engine's switch runs through here
        try:
            t = Txn(txn, index.dbs)
            for ref in refs:
                try:
                    r = parse_ref_cached(ref) if isinstance(ref, str) else parse_ref(ref)
                    if owners is not None and r.content_id is not None and not owned_by(t, r.content_id, owners):
                        raise BlobNotFound(f"no live adapter with content id {r.content_id}")
                    out.append(resolve_in(t, r))
                except MintError as e:
                    out.append(e)
        finally:
            txn.abort()
        return out

    def read_row(self, loc: Location, out: Any = None, *, verify: bool = True) -> Any:
        """Read one row into ``out`` (a writable buffer of at least ``loc.length`` bytes) with one call."""
        if out is None:
            out = np.empty(loc.length, dtype=np.uint8)
        view = memoryview(out)
        if view.nbytes != loc.length or view.ndim != 1 or view.format != "B":
            view = view.cast("B")
            if len(view) < loc.length:
                raise ValueError(f"buffer of {len(view)} bytes is smaller than the row ({loc.length})")
            view = view[: loc.length]
        try:
            self.storage.read_into(loc.shard_key, loc.offset, view)
        except BlobNotFound:
            raise StaleLocation(f"shard {loc.shard_key} is gone (compacted); resolve again") from None
        if verify and content_id(loc.layout_id, view) != loc.content_id:
            raise IntegrityError(
                f"row of content id {loc.content_id} in shard {loc.shard_key} at offset {loc.offset} does not "
                "match its content id; run `mint fsck`"
            )
        return out

    def read(self, ref: str | Ref, out: Any = None) -> tuple[Location, Any]:
        """Resolve and read, re-resolving once if the location went stale."""
        loc = self.resolve(ref)
        try:
            return loc, self.read_row(loc, out)
        except StaleLocation:
            loc = self.resolve(ref)
            return loc, self.read_row(loc, out)

    def read_row_zarr(self, loc: Location) -> np.ndarray:
        """The same row through Zarr's own read path (for cross-checks)."""
        if self._zstore is None:
            self._zstore = self.storage.zarr_store()
        return read_row_with_zarr(self._zstore, loc.layout_id, loc.row)

    def load(self, ref: str | Ref) -> Adapter:
        """The adapter a ref names; tensors are views of one freshly read row."""
        r = parse_ref(ref)
        loc, row = self.read(r)
        config = None
        if r.content_id is None:
            config = self.version(r).peft_config
        return Adapter.from_row(self.layout(loc.layout_id), row, peft_config=config)

    def layout(self, layout_id: str) -> Layout:
        with self._idx().read() as t:
            rec = t.get("layouts", layout_id.encode())
        if rec is None:
            raise LayoutNotFound(f"no layout {layout_id}")
        return Layout.from_dict(rec["layout"])

    def base(self, base: str) -> dict[str, list[int]]:
        with self._idx().read() as t:
            rec = t.get("bases", check_name(base, "base").encode())
        if rec is None:
            raise BaseNotFound(f"no base {base!r} registered")
        return dict(rec)

    def bases(self) -> dict[str, int]:
        """Every registered base, by name, with its number of modules."""
        with self._idx().read() as t:
            return {k.decode(): len(v) for k, v in t.scan("bases")}

    def _info(self, t: Txn, rec: dict[str, Any]) -> VersionInfo:
        tags = tuple(
            k.decode().rsplit(":", 1)[1]
            for k, v in t.scan("tags", f"{rec['tenant']}/{rec['name']}:".encode())
            if v["version"] == rec["version"]
        )
        return VersionInfo(
            rec["tenant"], rec["name"], rec["version"], rec["content_id"], rec["layout_id"], rec["nbytes"],
            rec["base"], rec["created"], rec["deleted"], rec["deduplicated"], tags, rec.get("peft_config"),
        )

    def version(self, ref: str | Ref) -> VersionInfo:
        """Metadata of the version a ref names (deleted versions included when named by number)."""
        r = parse_ref(ref)
        with self._idx().read() as t:
            return self._info(t, version_record(t, r))

    def versions(self, tenant: str, name: str) -> list[VersionInfo]:
        check_name(tenant, "tenant")
        check_name(name)
        with self._idx().read() as t:
            if t.get("names", f"{tenant}/{name}".encode()) is None:
                raise AdapterNotFound(f"no adapter {tenant}/{name}")
            return [self._info(t, rec) for _, rec in t.scan("versions", f"{tenant}/{name}@".encode())]

    def names(self, tenant: str, *, prefix: str = "", after: str | None = None, limit: int = 1000) -> list[str]:
        """Adapter names of a tenant in order, ``prefix``-filtered, starting after ``after``."""
        check_name(tenant, "tenant")
        start = f"{tenant}/{after}\x00".encode() if after else None
        out: list[str] = []
        with self._idx().read() as t:
            for k, _ in t.scan("names", f"{tenant}/{prefix}".encode(), start):
                out.append(k.decode().split("/", 1)[1])
                if len(out) >= limit:
                    break
        return out

    def tenants(self) -> list[str]:
        out: list[str] = []
        with self._idx().read() as t:
            start: bytes | None = None
            while True:
                it = t.scan("names", b"", start)
                first = next(it, None)
                if first is None:
                    return out
                tenant = first[0].decode().split("/", 1)[0]
                out.append(tenant)
                start = (tenant + "0").encode()  # '0' sorts right after '/'

    @property
    def last_seq(self) -> int:
        with self._idx().read() as t:
            return t.last_seq

    def events(self, after: int = 0, *, limit: int = 1000) -> list[dict[str, Any]]:
        with self._idx().read() as t:
            return [v for _, v in itertools.islice(t.scan("events", b"", seq_key(after + 1)), limit)]

    def index_stats(self) -> dict[str, int]:
        """Entries per index database, the index's bytes on disk and the last seq."""
        idx = self._idx()
        with idx.read() as t:
            out = {db: t.count(db) for db in ("names", "versions", "tags", "blobs", "layouts", "shards", "events")}
            out["last_seq"] = t.last_seq
        out["index_bytes"] = idx.nbytes()
        return out

    def iter_versions(self) -> Iterator[VersionInfo]:
        with self._idx().read() as t:
            for _, rec in t.scan("versions"):
                yield self._info(t, rec)
