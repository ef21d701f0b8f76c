"""The store: publish, tag, delete and read adapters over packs + log + index.

Writes go through one writer thread that group-commits whatever is queued: concurrent
publishes share one shard write per layout, one log object and one LMDB transaction.
Crash ordering for every write: shards durable -> log object durable -> index commit ->
reply. Reads never touch the writer: one LMDB read transaction to resolve, one read call
for the bytes, one hash to verify.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .adapter import Adapter, AdapterLimits, check_against_base, check_base_shapes
from .errors import (
    AdapterNotFound,
    BaseNotFound,
    BlobNotFound,
    Conflict,
    CrashInjected,
    DamagedAdapter,
    IntegrityError,
    InvalidAdapter,
    LayoutNotFound,
    MintError,
    ReadOnlyStore,
    StaleLocation,
    StoreClosed,
    TagNotFound,
    VersionDeleted,
    VersionNotFound,
)
from .hashing import content_id
from .index import Index, Txn, seq_key, version_key
from .layout import Layout, check_finite_rows
from .lock import WriterLock
from .log import CommitLog, apply_event
from .names import Ref, check_name, check_version, parse_ref
from .packs import SHARD_TARGET_BYTES, Pack, geometry_for, read_row_with_zarr
from .records import Location, PublishResult, VersionInfo
from .storage import LocalStorage, Storage, open_storage

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

    def __post_init__(self) -> None:
        unknown = set(self.crash_at) - set(CRASH_POINTS)
        if unknown:
            raise ValueError(f"unknown crash points {sorted(unknown)}; known: {CRASH_POINTS}")
        if self.shard_target_bytes < 1 or self.max_batch < 1:
            raise ValueError("shard_target_bytes and max_batch must be positive")


def default_index_dir(url: str) -> str:
    """``<store>/index`` for a local store; a per-URL directory under ~/.cache otherwise."""
    if "://" not in url or url.startswith("file://"):
        return str(Path(url.removeprefix("file://")) / "index")
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    base = os.environ.get("MINT_INDEX_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "mint-store")
    return os.path.join(base, digest)


@dataclass(slots=True)
class _Pending:
    tenant: str
    name: str
    layout: Layout
    row: np.ndarray
    cid: str
    tag: str | None
    peft_config: dict[str, Any] | None
    future: Future[PublishResult]


@dataclass(slots=True)
class _Op:
    kind: str
    args: dict[str, Any]
    future: Future[Any]


_STOP = object()


class Store:
    """Open with :meth:`open`. Thread-safe; one writable Store per index across processes."""

    def __init__(self, storage: Storage, config: StoreConfig, index_dir: str) -> None:
        self.storage = storage
        self.config = config
        self.index_dir = index_dir
        self.log = CommitLog(storage)
        self._pid = os.getpid()
        self._lock: WriterLock | None = None
        self._closed = False
        self._failed: BaseException | None = None
        self._listeners: list[Callable[[int], None]] = []
        self._packs: dict[str, Pack] = {}
        self._zstore: Any = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        if config.readonly:
            self._index = Index.acquire(index_dir, readonly=True)
        else:
            self._lock = WriterLock(index_dir)
            self._lock.acquire()
            try:
                self._index = Index.acquire(index_dir)
                self._replay()
            except BaseException:
                self._lock.release()
                raise
            self._thread = threading.Thread(target=self._run, name="mint-writer", daemon=True)
            self._thread.start()

    @classmethod
    def open(cls, url: str | os.PathLike[str] = "./mint-data", **options: Any) -> Store:
        """Open a store at a directory, ``file://`` or ``s3://`` URL. Options: StoreConfig fields."""
        config = StoreConfig(**options)
        text = os.fspath(url)
        storage = open_storage(text, storage_options=config.storage_options)
        index_dir = config.index_dir or default_index_dir(
            str(storage.root) if isinstance(storage, LocalStorage) else text
        )
        return cls(storage, config, index_dir)

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._pid == os.getpid():
            self._queue.put(_STOP)
            self._thread.join()
        if self._pid == os.getpid():
            self._index.release()
            if self._lock is not None:
                self._lock.release()
        self.storage.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writable(self) -> bool:
        return self._lock is not None

    def add_commit_listener(self, callback: Callable[[int], None]) -> None:
        """``callback(seq)`` runs on the writer thread after each index commit."""
        self._listeners.append(callback)

    def _idx(self) -> Index:
        if self._closed:
            raise StoreClosed("the store is closed")
        if self._pid != os.getpid():
            # never touch the parent's LMDB environment after fork: open our own, read-only
            self._forked_index = Index.acquire(self.index_dir, readonly=True)
            return self._forked_index
        return self._index

    def _replay(self) -> None:
        """Apply log objects that the index lacks (a crash between log write and commit)."""
        with self._index.read() as t:
            last = t.last_seq
        for event in self.log.after(last):
            with self._index.write() as w:
                apply_event(w, event)

    # -- writes ----------------------------------------------------------------------------

    def _submit(self, item: Any) -> None:
        if not self.writable:
            raise ReadOnlyStore("this store was opened read-only; open it writable to change it")
        if self._pid != os.getpid():
            raise ReadOnlyStore("this store was opened by the parent process; open it again in this process")
        if self._closed:
            raise StoreClosed("the store is closed")
        if self._failed is not None:
            raise StoreClosed(f"the writer stopped after an error ({self._failed!r}); reopen the store")
        self._queue.put(item)

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
        fut: Future[PublishResult] = Future()
        cid = content_id(layout.layout_id, row)
        self._submit(_Pending(tenant, name, layout, row, cid, tag, adapter.peft_config, fut))
        return fut

    def publish(self, tenant: str, name: str, adapter: Adapter, *, tag: str | None = None) -> PublishResult:
        return self.publish_async(tenant, name, adapter, tag=tag).result()

    def publish_many(
        self, items: Iterable[tuple[str, str, Adapter] | tuple[str, str, Adapter, str | None]]
    ) -> list[PublishResult]:
        futs = [self.publish_async(*it[:3], tag=it[3] if len(it) > 3 else None) for it in items]  # type: ignore[misc]
        return [f.result() for f in futs]

    def publish_rows(
        self, names: Sequence[tuple[str, str]], layout: Layout, rows: np.ndarray, *, tag: str | None = None
    ) -> list[PublishResult]:
        """Bulk publish of pre-encoded rows ([N, S] uint8, e.g. from ``encode_rows``)."""
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
        futs: list[Future[PublishResult]] = []
        for (tenant, name), row in zip(names, rows, strict=True):
            fut: Future[PublishResult] = Future()
            cid = content_id(layout.layout_id, row)
            self._submit(_Pending(tenant, name, layout, row, cid, tag, None, fut))
            futs.append(fut)
        return [f.result() for f in futs]

    def _op(self, kind: str, **args: Any) -> Any:
        fut: Future[Any] = Future()
        self._submit(_Op(kind, args, fut))
        return fut.result()

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

    def register_base(self, base: str, shapes: dict[str, Any]) -> None:
        """Record a base's module shapes; later publishes naming it are checked against them."""
        self._op("base", base=check_name(base, "base"), shapes=check_base_shapes(shapes))

    # -- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        pending: list[Any] = []
        while True:
            item = pending.pop(0) if pending else self._queue.get()
            if item is _STOP:
                self._fail_queued(StoreClosed("the store closed before this write was committed"))
                return
            batch = [item]
            nbytes = 0
            if isinstance(item, _Pending):
                nbytes = item.layout.row_nbytes
                while len(batch) < self.config.max_batch and nbytes < self.config.max_batch_bytes:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if not isinstance(nxt, _Pending):
                        pending.append(nxt)
                        break
                    batch.append(nxt)
                    nbytes += nxt.layout.row_nbytes
            try:
                if isinstance(item, _Pending):
                    self._commit_publishes(batch)
                else:
                    self._commit_op(item)
            except CrashInjected as e:
                self._failed = e
                for b in batch + pending:
                    if isinstance(b, _Pending | _Op) and not b.future.done():
                        b.future.set_exception(CrashInjected(str(e)))
                self._fail_queued(CrashInjected("the writer crashed"))
                return
            except BaseException as e:  # a storage or index failure: stop, reopen replays
                self._failed = e
                for b in batch:
                    if not b.future.done():
                        b.future.set_exception(e)
                self._fail_queued(StoreClosed(f"the writer stopped after an error ({e!r}); reopen the store"))
                return

    def _fail_queued(self, err: BaseException) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Pending | _Op) and not item.future.done():
                item.future.set_exception(err)

    def _crash(self, point: str) -> None:
        if point in self.config.crash_at:
            raise CrashInjected(point)

    def _pack(self, layout: Layout, lay_rec: dict[str, Any] | None) -> Pack:
        pack = self._packs.get(layout.layout_id)
        if pack is None:
            if self._zstore is None:
                self._zstore = self.storage.zarr_store()
            geometry = geometry_for(layout.row_nbytes, shard_target_bytes=self.config.shard_target_bytes)
            if lay_rec is not None:  # geometry is fixed at creation; later config changes don't apply
                geometry = type(geometry)(layout.row_nbytes, lay_rec["rows_per_shard"], lay_rec["chunk_cols"])
            pack = Pack.open_or_create(self.storage, self._zstore, layout, geometry)
            self._packs[layout.layout_id] = pack
        return pack

    def _commit_publishes(self, batch: list[_Pending]) -> None:
        accepted: list[tuple[_Pending, int, bool]] = []  # (item, version, deduplicated)
        new_rows: dict[str, list[_Pending]] = {}
        first_of: dict[str, _Pending] = {}
        layouts: dict[str, dict[str, Any] | None] = {}
        with self._index.read() as t:
            next_version: dict[tuple[str, str], int] = {}
            bases: dict[str, Any] = {}
            for p in batch:
                try:
                    if p.layout.base not in bases:
                        bases[p.layout.base] = t.get("bases", p.layout.base.encode())
                    if bases[p.layout.base] is not None:
                        shapes = {k: (v[0], v[1], v[2] if len(v) > 2 else None) for k, v in bases[p.layout.base].items()}
                        check_against_base(p.layout, shapes)
                    dedup = self._dedup(t, p, first_of)
                except MintError as e:
                    p.future.set_exception(e)
                    continue
                key = (p.tenant, p.name)
                if key not in next_version:
                    rec = t.get("names", f"{p.tenant}/{p.name}".encode())
                    next_version[key] = rec["next"] if rec else 1
                version = next_version[key]
                next_version[key] += 1
                accepted.append((p, version, dedup))
                if not dedup:
                    first_of[p.cid] = p
                    new_rows.setdefault(p.layout.layout_id, []).append(p)
                    if p.layout.layout_id not in layouts:
                        layouts[p.layout.layout_id] = t.get("layouts", p.layout.layout_id.encode())
            last_seq = t.last_seq
        if not accepted:
            return
        event_layouts: list[dict[str, Any]] = []
        event_rows: list[dict[str, Any]] = []
        for layout_id, items in new_rows.items():
            lay_rec = layouts[layout_id]
            pack = self._pack(items[0].layout, lay_rec)
            if lay_rec is None:
                g = pack.geometry
                event_layouts.append(
                    {"layout_id": layout_id, "layout": items[0].layout.to_dict(),
                     "rows_per_shard": g.rows_per_shard, "chunk_cols": g.chunk_cols}
                )
            start = pack.next_free_row(lay_rec["next_row"] if lay_rec else 0)
            placements = pack.write_rows(start, np.stack([p.row for p in items]), crash=self._crash)
            for p, pl in zip(items, placements, strict=True):
                event_rows.append(
                    {"content_id": p.cid, "layout_id": layout_id, "row": pl.row, "shard": pl.shard_key,
                     "offset": pl.offset, "length": pl.length}
                )
        self._crash("after_shards")
        seq = last_seq + 1
        now = time.time()
        versions = [
            {"tenant": p.tenant, "name": p.name, "version": v, "content_id": p.cid,
             "layout_id": p.layout.layout_id, "base": p.layout.base, "nbytes": p.layout.row_nbytes,
             "tag": p.tag, "deduplicated": d, "peft_config": p.peft_config}
            for p, v, d in accepted
        ]
        event = {"seq": seq, "kind": "publish", "time": now, "layouts": event_layouts, "rows": event_rows,
                 "versions": versions}
        self._commit_event(event)
        for p, v, d in accepted:
            p.future.set_result(
                PublishResult(p.tenant, p.name, v, p.cid, p.layout.layout_id, p.layout.row_nbytes, d, seq)
            )

    def _dedup(self, t: Txn, p: _Pending, first_of: dict[str, _Pending]) -> bool:
        """True when identical bytes are already stored (confirmed byte for byte)."""
        earlier = first_of.get(p.cid)
        if earlier is not None:
            if not np.array_equal(earlier.row, p.row):
                raise IntegrityError(f"content id {p.cid} collides with different bytes; refusing")
            return True
        blob = t.get("blobs", p.cid.encode())
        if blob is None or blob["state"] != "ok":
            return False
        stored = np.empty(blob["length"], dtype=np.uint8)
        try:
            self.storage.read_into(blob["shard"], blob["offset"], memoryview(stored))
        except BlobNotFound:
            return False
        if not np.array_equal(stored, p.row):
            raise IntegrityError(f"content id {p.cid} collides with different stored bytes; refusing")
        return True

    def _commit_event(self, event: dict[str, Any]) -> None:
        self.log.write(event)
        self._crash("after_log")
        with self._index.write() as w:
            apply_event(w, event)
        self._crash("after_index")
        for cb in self._listeners:
            cb(int(event["seq"]))

    def _commit_op(self, op: _Op) -> None:
        try:
            with self._index.read() as t:
                event: dict[str, Any] = {"seq": t.last_seq + 1, "time": time.time(), "kind": op.kind}
                result: Any = None
                if op.kind == "tag":
                    ref: Ref = op.args["ref"]
                    info = self._version_txn(t, ref)
                    if info["deleted"]:
                        raise VersionDeleted(f"{ref} is deleted; tag another version")
                    event.update(tenant=ref.tenant, name=ref.name, version=info["version"], tag=op.args["tag"])
                    result = info["version"]
                elif op.kind == "untag":
                    key = f"{op.args['tenant']}/{op.args['name']}:{op.args['tag']}".encode()
                    version = t.get("tags", key)
                    if version is None:
                        raise TagNotFound(f"no tag {op.args['tag']!r} on {op.args['tenant']}/{op.args['name']}")
                    event.update(op.args, version=version)
                elif op.kind == "delete":
                    ref = op.args["ref"]
                    info = self._version_txn(t, ref)
                    if info["deleted"]:
                        raise VersionDeleted(f"{ref.tenant}/{ref.name}@{info['version']} is already deleted")
                    event.update(tenant=ref.tenant, name=ref.name, version=info["version"])
                    result = info["version"]
                elif op.kind == "base":
                    old = t.get("bases", op.args["base"].encode())
                    shapes = {k: list(v if v[2] is not None else v[:2]) for k, v in op.args["shapes"].items()}
                    if old is not None and old != shapes:
                        raise Conflict(f"base {op.args['base']!r} is already registered with other shapes")
                    event.update(base=op.args["base"], shapes=shapes)
                else:
                    raise ValueError(f"unknown op {op.kind}")
        except MintError as e:
            op.future.set_exception(e)
            return
        self._commit_event(event)
        op.future.set_result(result)

    # -- reads -----------------------------------------------------------------------------

    def _version_txn(self, t: Txn, r: Ref) -> dict[str, Any]:
        if r.tenant is None or r.name is None:
            raise AdapterNotFound(f"{r} does not name a version")
        version = r.version
        if version is None:
            if r.tag is not None:
                version = t.get("tags", f"{r.tenant}/{r.name}:{r.tag}".encode())
                if version is None:
                    raise TagNotFound(f"no tag {r.tag!r} on {r.tenant}/{r.name}")
            else:
                rec = t.get("names", f"{r.tenant}/{r.name}".encode())
                if rec is None:
                    raise AdapterNotFound(f"no adapter {r.tenant}/{r.name}")
                if rec["latest"] is None:
                    raise VersionDeleted(f"every version of {r.tenant}/{r.name} is deleted")
                version = rec["latest"]
        info = t.get("versions", version_key(r.tenant, r.name, version))
        if info is None:
            if t.get("names", f"{r.tenant}/{r.name}".encode()) is None:
                raise AdapterNotFound(f"no adapter {r.tenant}/{r.name}")
            raise VersionNotFound(f"no version {version} of {r.tenant}/{r.name}")
        return dict(info)

    def _resolve_txn(self, t: Txn, r: Ref) -> Location:
        if r.content_id is not None:
            cid = r.content_id
            blob = t.get("blobs", cid.encode())
            if blob is None or blob["refs"] <= 0:
                raise BlobNotFound(f"no live adapter with content id {cid}")
        else:
            info = self._version_txn(t, r)
            if info["deleted"]:
                raise VersionDeleted(f"{r.tenant}/{r.name}@{info['version']} is deleted")
            cid = info["content_id"]
            blob = t.get("blobs", cid.encode())
        if blob["state"] != "ok":
            raise DamagedAdapter(f"{r} (content id {cid}) is quarantined as damaged; republish it")
        return Location(cid, blob["layout_id"], blob["shard"], blob["offset"], blob["length"], blob["row"])

    def resolve(self, ref: str | Ref) -> Location:
        """ref -> location, in one read transaction."""
        r = parse_ref(ref)
        with self._idx().read() as t:
            return self._resolve_txn(t, r)

    def resolve_many(self, refs: Sequence[str | Ref]) -> list[Location | MintError]:
        """Many refs in one read transaction; a failed ref yields its error in place."""
        out: list[Location | MintError] = []
        with self._idx().read() as t:
            for ref in refs:
                try:
                    out.append(self._resolve_txn(t, parse_ref(ref)))
                except MintError as e:
                    out.append(e)
        return out

    def read_row(self, loc: Location, out: Any = None, *, verify: bool = True) -> Any:
        """Read one row into ``out`` (a writable buffer of ``loc.length`` bytes) with one call."""
        if out is None:
            out = np.empty(loc.length, dtype=np.uint8)
        view = memoryview(out).cast("B")
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

    def _info(self, t: Txn, rec: dict[str, Any]) -> VersionInfo:
        tags = tuple(
            k.decode().rsplit(":", 1)[1]
            for k, v in t.scan("tags", f"{rec['tenant']}/{rec['name']}:".encode())
            if v == rec["version"]
        )
        return VersionInfo(
            rec["tenant"], rec["name"], rec["version"], rec["content_id"], rec["layout_id"], rec["nbytes"],
            rec["base"], rec["created"], rec["deleted"], rec["deduplicated"], tags, rec.get("peft_config"),
        )

    def version(self, ref: str | Ref) -> VersionInfo:
        """Metadata of the version a ref names (deleted versions included when named by number)."""
        r = parse_ref(ref)
        with self._idx().read() as t:
            return self._info(t, self._version_txn(t, r))

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
            return [v for _, v in t.scan("events", b"", seq_key(after + 1))][:limit]

    def iter_versions(self) -> Iterator[VersionInfo]:
        with self._idx().read() as t:
            for _, rec in t.scan("versions"):
                yield self._info(t, rec)
