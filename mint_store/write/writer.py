"""The writer thread: group commit of everything queued, in crash-safe order.

Concurrent publishes share one shard write per layout, one log object and one LMDB
transaction. Order per commit: shards durable -> log object durable -> index commit ->
futures resolved (the reply). Every check that could race with another writer (version
numbers, dedup, tag targets) runs here, on the one thread that commits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..config import StoreConfig
from ..errors import (
    CommitConflict,
    Conflict,
    CrashInjected,
    IntegrityError,
    MintError,
    ShardTaken,
    StoreClosed,
    StoreUnavailable,
    TagNotFound,
    VersionDeleted,
    WriterFenced,
)
from ..format.adapter import check_against_base
from ..format.blocks import write_block_tables
from ..format.layout import Layout
from ..format.names import Ref
from ..format.packs import Pack, geometry_for
from ..index.commit_log import CommitLog, apply_event, log_key
from ..index.lmdb_index import Index, Txn
from ..index.queries import owned_by, version_record
from ..maintenance.writer_ops import WriterMaintenance
from ..results import PublishResult
from ..storage import Storage
from .lease import WriterLease
from .queue import MAINTENANCE_OPS, STOP, PendingPublish, WriteOp, fail_item
from .recovery import WriterHealth, WriterRecovery, replay

log = logging.getLogger("mint.writer")


class Writer(WriterMaintenance, WriterRecovery):
    """Owns the commit path. ``gate`` cleared holds commits (tests use it to force batches)."""

    def __init__(self, storage: Storage, index: Index, log: CommitLog, config: StoreConfig,
                 lease: WriterLease | None = None, *, fault_hook: Callable[[str], None] | None = None) -> None:
        self.storage = storage
        self.lease = lease
        self.index = index
        self.log = log
        self.config = config
        self.fault_hook = fault_hook  # called at each crash point; the kill-safety tests raise there
        self.queue: queue.Queue[Any] = queue.Queue()
        self.failed: BaseException | None = None
        self.listeners: list[Callable[[int], None]] = []
        self.batch_listeners: list[Callable[[int], None]] = []
        # callback([(shard key, offset, length, content id)]) after new rows' shards are created:
        # rows whose content ids this writer computed from the very bytes it wrote
        self.row_listeners: list[Callable[[list[tuple[str, int, int, str]]], None]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.health = WriterHealth()
        # (seq, complete) of the commit being written: if a failure comes after its log
        # object reached storage, recovery replays it and ``complete`` answers its callers
        self._inflight: tuple[int, Callable[[], None] | None, dict[str, Any]] | None = None
        self._packs: dict[str, Pack] = {}
        self._probe_shards = False  # packs opened now look for taken shard names (write/recovery.py)
        self._zstore: Any = None
        self._thread = threading.Thread(target=self._run, name="mint-writer", daemon=True)
        self._thread.start()

    def submit(self, item: Any) -> None:
        self.queue.put(item)

    def stop(self) -> None:
        self.queue.put(STOP)
        self.gate.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # an error escaped the loop's own handling: stop as after any other
            log.exception("the writer thread stopped")
            self.failed = self.failed or e
            self._give_up_lease()
            self._fail_queued(StoreClosed(f"the writer stopped after an error ({e!r}); reopen the store"))

    def _loop(self) -> None:
        pending: list[Any] = []
        requeued: Any = None  # an item sent round again after a shard name was taken
        while True:
            item = pending.pop(0) if pending else self._next_item()
            self.gate.wait()
            if item is STOP:
                self._fail_queued(StoreClosed("the store closed before this write was committed"))
                return
            if isinstance(item, list):  # bundles of publishes: take every bundle queued behind it
                batch: list[PendingPublish] = list(item)
                nbytes = sum(p.layout.row_nbytes for p in item)
                while len(batch) < self.config.max_batch and nbytes < self.config.max_batch_bytes:
                    try:
                        nxt = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if not isinstance(nxt, list):
                        pending.append(nxt)
                        break
                    batch.extend(nxt)
                    nbytes += sum(p.layout.row_nbytes for p in nxt)
                sinks = list({id(p.sink): p.sink for p in batch}.values())
            else:
                sinks = [item.sink]
            self._inflight = None  # never a commit of an earlier item
            try:
                if self.lease is not None:  # a fenced writer writes nothing, not even a shard
                    self.lease.check()
                if isinstance(item, list):
                    self._commit_publishes(batch)
                else:
                    self._commit_op(item)
                if self._probe_shards:  # past the orphans: plan from the shapes again
                    self._probe_shards = False
                    for pack in self._packs.values():
                        pack.probe_taken = False
            except CrashInjected as e:
                self.failed = e
                if self.lease is not None:  # as a real crash: the renewals stop, the lease expires
                    self.lease.stop_renewing()
                for sink in sinks:
                    sink.fail(CrashInjected(str(e)))
                for b in pending:
                    fail_item(b, CrashInjected("the writer crashed"))
                self._fail_queued(CrashInjected("the writer crashed"))
                return
            except WriterFenced as e:  # another writer holds the store: never "recover" its commits as ours
                try:  # (each looks at the lease first)
                    past = isinstance(e, ShardTaken) and self._past_orphan_shard(e)
                    caught = not past and isinstance(e, CommitConflict) and self._caught_up_after_conflict(e, sinks)
                except StoreUnavailable as u:  # the lease could not be looked at: a storage failure, not a fence
                    if isinstance(e, CommitConflict):
                        self._inflight = None  # the create-only log write proved nothing of it was logged
                    if not self._storage_failed(u, sinks, pending):
                        return
                    continue
                if past:
                    if item is not requeued:  # planned again, once, past the previous writer's orphans
                        requeued = batch if isinstance(item, list) else item
                        pending.insert(0, requeued)
                        continue
                    for sink in sinks:  # taken again: this commit fails alone, the writer goes on
                        sink.fail(CommitConflict(f"{e}; nothing of this request was committed: send it again"))
                    continue
                if caught:
                    continue  # a late commit of the writer before us took our seq: applied, we go on
                self.failed = e
                self.health.degrade(f"fenced: {e}")
                self._give_up_lease()
                for sink in sinks:
                    sink.fail(e)
                for b in pending:
                    fail_item(b, e)
                self._fail_queued(e)
                self._follow_after_fence(e)
                return
            except Exception as e:  # a storage or index failure: fail this commit, recover in place
                if not self._storage_failed(e, sinks, pending):
                    return
            except BaseException as e:  # not an error of the storage: stop, reopen replays
                self.failed = e
                self._give_up_lease()
                for sink in sinks:
                    sink.fail(e)
                err = StoreClosed(f"the writer stopped after an error ({e!r}); reopen the store")
                for b in pending:
                    fail_item(b, err)
                self._fail_queued(err)
                return

    def _storage_failed(self, e: Exception, sinks: list[Any], pending: list[Any]) -> bool:
        """Fail this commit and recover in place; False when the store closed meanwhile."""
        self._after_failure(e, sinks)
        if not self.health.writable:
            for b in pending:
                fail_item(b, self._unavailable())
            pending.clear()
            if not self._recover_until_stopped():
                return False
        return True

    def _give_up_lease(self) -> None:
        """This writer thread ends and commits nothing more: release the lease (if still ours), so
        a standby takes over now, not never (the renew thread would hold it for the process)."""
        if self.lease is None:
            return
        try:
            self.lease.release()
        except Exception:  # it expires on its own once the renewals stop
            log.warning("could not release the writer lease", exc_info=True)
            self.lease.stop_renewing()

    def _next_item(self) -> Any:
        """The next queued item. Idle, a writer holding a lease looks past its head every
        ``lease_renew_s``: a commit of the writer before it, paused between its lease check and
        its log write, can still land after the take-over (the create-only log accepts it at
        the next free seq, and that writer answers it). Applied then, it is visible here within
        a renewal, not only once this writer's next commit finds the seq taken."""
        while True:
            try:
                return self.queue.get(timeout=self.config.lease_renew_s if self.lease is not None else None)
            except queue.Empty:
                if self.gate.is_set():
                    self._catch_up_tail()

    def _catch_up_tail(self, why: str | None = "a late commit of the writer before it") -> None:
        try:
            with self.index.read() as t:
                nxt = log_key(t.last_seq + 1)
            if self.storage.exists(nxt):
                if why is not None:
                    log.warning("%s landed past this writer's head (%s); applying it", nxt, why)
                replay(self.index, self.log, self._notify)  # (no write probe: nothing failed)
        except Exception:  # a failed look is tried again at the next; writes are unaffected
            log.warning("looking past the log head failed", exc_info=True)

    def _follow_after_fence(self, err: WriterFenced) -> None:
        """Fenced (another writer holds the store): commit nothing, but keep this index moving
        with the log, as a replica does, until the store closes. Stopped instead, the process
        went on serving reads and the change feed from the index of the moment it was fenced."""
        while True:
            try:
                item = self.queue.get(timeout=self.config.lease_renew_s)
            except queue.Empty:
                self._catch_up_tail(why=None)
                continue
            if item is STOP:
                self._fail_queued(StoreClosed("the store closed"))
                return
            fail_item(item, err)

    def _notify(self, seq: int) -> None:
        for cb in self.listeners:
            try:
                cb(seq)
            except Exception:  # a listener's bug must not fail a commit that is already durable
                log.exception("commit listener failed at seq %d", seq)

    def _fail_queued(self, err: BaseException) -> None:
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            fail_item(item, err)

    def _crash(self, point: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point)

    def _pack(self, layout: Layout, lay_rec: dict[str, Any] | None) -> Pack:
        pack = self._packs.get(layout.layout_id)
        if pack is None:
            if self._zstore is None:
                self._zstore = self.storage.zarr_store()
            geometry = geometry_for(layout.row_nbytes, shard_target_bytes=self.config.shard_target_bytes)
            if lay_rec is not None:  # geometry is fixed at creation; later config changes don't apply
                geometry = type(geometry)(layout.row_nbytes, lay_rec["rows_per_shard"], lay_rec["chunk_cols"])
            pack = Pack.open_or_create(self.storage, self._zstore, layout, geometry)
            pack.probe_taken = self._probe_shards
            self._packs[layout.layout_id] = pack
        return pack

    def _commit_publishes(self, batch: list[PendingPublish]) -> None:
        with self.index.read() as t:
            failed: dict[int, BaseException] = {}
            bases: dict[str, Any] = {}
            for p in batch:
                if id(p.sink) in failed:
                    continue
                try:
                    if p.layout.base not in bases:
                        bases[p.layout.base] = t.get("bases", p.layout.base.encode())
                    if bases[p.layout.base] is not None:
                        shapes = {
                            k: (v[0], v[1], v[2] if len(v) > 2 else None) for k, v in bases[p.layout.base].items()
                        }
                        check_against_base(p.layout, shapes)
                except MintError as e:
                    failed[id(p.sink)] = e
            while True:  # a refused adapter drops its whole bundle; redo the plan without it
                plan = self._plan(t, [p for p in batch if id(p.sink) not in failed], failed)
                if plan is not None:
                    break
            accepted, new_rows, layouts = plan
            last_seq = t.last_seq
        for p in batch:
            if id(p.sink) in failed:
                p.sink.fail(failed[id(p.sink)])
        if not accepted:
            return
        for bcb in self.batch_listeners:
            try:
                bcb(len(accepted))
            except Exception:
                log.exception("batch listener failed")
        event_layouts: list[dict[str, Any]] = []
        # compact on purpose: the log is storage overhead, ~100 bytes per adapter
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
            stacked = np.stack([p.row for p in items])
            placements = pack.write_rows(start, stacked, crash=self._crash,
                                         check=self.lease.check if self.lease is not None else None)
            shards: dict[str, list[list[Any]]] = {}
            for p, pl in zip(items, placements, strict=True):
                shards.setdefault(pl.shard_key, []).append([p.cid, pl.row, pl.offset])
            self._rows_written([(pl.shard_key, pl.offset, pack.geometry.row_nbytes, p.cid)
                                for p, pl in zip(items, placements, strict=True)])
            anchors = write_block_tables(self.storage, items[0].layout, [p.cid for p in items], stacked,
                                         [pl.shard_key for pl in placements])
            event_rows.append(
                {"layout_id": layout_id, "length": pack.geometry.row_nbytes,
                 "shards": [{"key": k, "rows": v, **({"blocks": anchors[k]} if k in anchors else {})}
                            for k, v in shards.items()]}
            )
        self._crash("after_shards")
        seq = last_seq + 1
        now = time.time()
        # [tenant, name, version, content_id, tag, deduplicated, peft_config]
        versions = [[p.tenant, p.name, v, p.cid, p.tag, d, p.peft_config] for p, v, d in accepted]
        event = {"seq": seq, "kind": "publish", "time": now, "layouts": event_layouts, "rows": event_rows,
                 "versions": versions}

        def complete() -> None:
            for p, v, d in accepted:
                result = PublishResult(p.tenant, p.name, v, p.cid, p.layout.layout_id, p.layout.row_nbytes, d, seq)
                p.sink.ok(p.slot, result)

        self._commit_event(event, complete)

    def _plan(
        self, t: Txn, items: list[PendingPublish], failed: dict[int, BaseException]
    ) -> tuple[list[tuple[PendingPublish, int, bool]], dict[str, list[PendingPublish]], dict[str, Any]] | None:
        """Versions, dedup and new rows for ``items``; None (with ``failed`` grown) to replan."""
        accepted: list[tuple[PendingPublish, int, bool]] = []  # (item, version, deduplicated)
        new_rows: dict[str, list[PendingPublish]] = {}
        first_of: dict[str, PendingPublish] = {}
        held: set[tuple[str, str]] = set()  # (tenant, content id) of this batch
        layouts: dict[str, dict[str, Any] | None] = {}
        next_version: dict[tuple[str, str], int] = {}
        for p in items:
            try:
                dedup = self._dedup(t, p, first_of)
            except MintError as e:
                failed[id(p.sink)] = e
                return None
            key = (p.tenant, p.name)
            if key not in next_version:
                rec = t.get("names", f"{p.tenant}/{p.name}".encode())
                next_version[key] = rec["next"] if rec else 1
            version = next_version[key]
            next_version[key] += 1
            # reported per tenant: "deduplicated" must not tell a tenant that another one
            # holds these bytes (the row is shared all the same)
            mine = (p.tenant, p.cid) in held or owned_by(t, p.cid, (p.tenant,))
            held.add((p.tenant, p.cid))
            accepted.append((p, version, dedup and mine))
            if not dedup:
                first_of[p.cid] = p
                new_rows.setdefault(p.layout.layout_id, []).append(p)
                if p.layout.layout_id not in layouts:
                    layouts[p.layout.layout_id] = t.get("layouts", p.layout.layout_id.encode())
        return accepted, new_rows, layouts

    def _dedup(self, t: Txn, p: PendingPublish, first_of: dict[str, PendingPublish]) -> bool:
        """True when identical bytes are already stored (confirmed byte for byte)."""
        earlier = first_of.get(p.cid)
        if earlier is not None:
            if not np.array_equal(earlier.row, p.row):
                raise IntegrityError(f"content id {p.cid} collides with different bytes; refusing")
            return True
        blob = t.get("blobs", p.cid.encode())
        stored = None if blob is None else self._stored_row(blob)
        if stored is None:  # none, quarantined or lost: written again
            return False
        if not np.array_equal(stored, p.row):
            raise IntegrityError(f"content id {p.cid} collides with different stored bytes; refusing")
        return True

    def _rows_written(self, rows: list[tuple[str, int, int, str]]) -> None:
        for cb in self.row_listeners:
            try:
                cb(rows)
            except Exception:  # a listener's trouble is not the publish's
                log.exception("row listener failed")

    def _commit_event(self, event: dict[str, Any], complete: Callable[[], None] | None = None) -> None:
        """Log object (create-only), then index, then listeners; then ``complete()`` answers the callers."""
        if self.lease is not None:  # a fenced writer stops before its log object
            self.lease.check()
            event["epoch"] = self.lease.epoch
        self._inflight = (int(event["seq"]), complete, event)
        self.log.write(event)
        self._crash("after_log")
        with self.index.write() as w:
            apply_event(w, event)
        self._inflight = None
        self._crash("after_index")
        self._notify(int(event["seq"]))  # before the reply: a caller that sees it sees the feed at it
        if complete is not None:
            complete()

    def _commit_op(self, op: WriteOp) -> None:
        try:
            with self.index.read() as t:
                event: dict[str, Any] = {"seq": t.last_seq + 1, "time": time.time(), "kind": op.kind}
                result: Any = None
                if op.kind == "tag":
                    ref: Ref = op.args["ref"]
                    info = version_record(t, ref)
                    if info["deleted"]:
                        raise VersionDeleted(f"{ref} is deleted; tag another version")
                    event.update(tenant=ref.tenant, name=ref.name, version=info["version"], tag=op.args["tag"])
                    result = info["version"]
                elif op.kind == "untag":
                    key = f"{op.args['tenant']}/{op.args['name']}:{op.args['tag']}".encode()
                    tagged = t.get("tags", key)
                    if tagged is None:
                        raise TagNotFound(f"no tag {op.args['tag']!r} on {op.args['tenant']}/{op.args['name']}")
                    event.update(op.args, version=tagged["version"])
                elif op.kind == "delete":
                    ref = op.args["ref"]
                    info = version_record(t, ref)
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
                elif op.kind in MAINTENANCE_OPS:
                    pass
                else:
                    raise ValueError(f"unknown op {op.kind}")
        except MintError as e:
            op.sink.fail(e)
            return
        if op.kind in MAINTENANCE_OPS:
            op.sink.future.set_result(getattr(self, f"_op_{op.kind}")(event, **op.args))
            return
        self._commit_event(event, lambda: op.sink.future.set_result(result))
