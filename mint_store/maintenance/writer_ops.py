"""The writer's maintenance operations: compaction, sweep, quarantine, orphan removal.

Half of :class:`~mint_store.write.writer.Writer`: each runs on the writer thread, between
commits, so that nothing a publish has in flight is ever touched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import BlobNotFound, IntegrityError
from ..format.blocks import shard_of_table, table_key
from ..format.hashing import content_id
from ..format.keys import check_shard_key
from ..format.layout import Layout
from ..format.packs import Pack
from ..index.lmdb_index import Index
from ..index.queries import blob_location
from ..read.buffers import empty_row
from ..read.verified import read_verified
from ..read.vread import read_ranges_into
from ..storage import Storage
from .sweep_clock import retired_since


class WriterMaintenance:
    """The maintenance half of :class:`~mint_store.write.writer.Writer` (``_op_<kind>`` per op)."""

    storage: Storage
    index: Index
    lease: Any  # the writer's lease (None: a store with no lease, such as an in-process memory:// one)
    _retired_first_seen: dict[str, float]  # (maintenance/sweep_clock.py) set at the first sweep

    def _pack(self, layout: Layout, lay_rec: dict[str, Any] | None) -> Pack:
        raise NotImplementedError

    def _crash(self, point: str) -> None:
        raise NotImplementedError

    def _commit_event(self, event: dict[str, Any], complete: Callable[[], None] | None = None) -> None:
        raise NotImplementedError

    # -- maintenance: run here so that nothing a publish has in flight is ever touched -------

    def _op_compact(self, event: dict[str, Any], *, layout_id: str, shards: list[str],
                    content_ids: list[str]) -> dict[str, Any]:
        """Rewrite the live rows of ``shards`` into new full shards; retire the old ones."""
        wanted = set(shards)
        moving: list[tuple[str, np.ndarray]] = []
        drops: list[str] = []
        damaged: list[str] = []
        keep: set[str] = set()  # shards that still hold a row we could not move
        with self.index.read() as t:
            lay_rec = t.get("layouts", layout_id.encode())
            if lay_rec is None:
                raise ValueError(f"no layout {layout_id}")
            layout = Layout.from_dict(lay_rec["layout"])
            live: list[tuple[str, dict[str, Any]]] = []
            for cid in content_ids:
                blob = t.get("blobs", cid.encode())
                if blob is None or blob["shard"] not in wanted:
                    continue  # moved or dropped since it was planned
                if blob["refs"] == 0:
                    drops.append(cid)
                    continue
                live.append((cid, blob))
            for (cid, blob), row in zip(live, self._checked_rows(live), strict=True):
                if row is None:  # never copy bad bytes into a new shard; quarantined below
                    damaged.append(cid)
                    keep.add(blob["shard"])
                    continue
                moving.append((cid, row))
        moves: list[list[Any]] = []
        if moving:
            pack = self._pack(layout, lay_rec)
            start = pack.next_free_row(lay_rec["next_row"])
            placements = pack.write_rows(start, np.stack([r for _, r in moving]), crash=self._crash,
                                         check=self.lease.check if self.lease is not None else None)
            moves = [[cid, pl.row, pl.shard_key, pl.offset] for (cid, _), pl in zip(moving, placements, strict=True)]
        self._crash("after_shards")
        retired = sorted(wanted - keep)
        if moves or drops or retired:
            event.update(kind="compact", layout_id=layout_id, length=layout.row_nbytes, moves=moves, drops=drops,
                         retired=retired)
            self._commit_event(event)
        if damaged:
            # proven unusable here (shard gone or short, or bytes not their content id; a read that
            # failed otherwise raised): quarantined now, as fsck --repair would. Left as they were,
            # their shard was planned again at every pass, paired with the shard the good rows had
            # just moved into, and those rows were rewritten every time
            with self.index.read() as t:
                nxt: dict[str, Any] = {"seq": t.last_seq + 1, "time": time.time(), "kind": "quarantine"}
            self._op_quarantine(nxt, content_ids=damaged)
        return {"moved": len(moves), "dropped": len(drops), "retired": retired, "damaged": damaged,
                "bytes_moved": len(moves) * layout.row_nbytes,
                "new_shards": sorted({m[2] for m in moves})}

    def _op_sweep(self, event: dict[str, Any], *, grace_s: float, now: float) -> list[str]:
        """Delete retired shards older than the grace period (index first, then objects).

        The grace period is measured on this reader's clock (``now``), from when the storage
        recorded the compaction that retired the shard (:func:`~mint_store.maintenance.sweep_clock.retired_since`),
        never from the event's own ``time`` field: a planted event saying ``"time": 0`` would
        otherwise have its shards deleted at once, under engines still reading them."""
        with self.index.read() as t:
            retired = {k.decode(): rec for k, rec in t.scan("shards") if rec.get("retired_at") is not None}
            since = retired_since(t, self.storage, list(retired), now=now, first_seen=self._retired_seen())
        recs = {k: rec for k, rec in retired.items() if since[k] + grace_s <= now}
        due = list(recs)
        if not due:
            return []
        for key in due:  # (the index only holds keys apply_event checked; checked again before a delete)
            check_shard_key(key, where="the index's retired shards")
        event.update(kind="sweep", shards=due)
        self._commit_event(event)
        for key in due:  # a crash here leaves orphans, which fsck --repair removes
            self.storage.delete(key)
            if recs[key].get("blocks") is not None:  # its block table goes with it
                self.storage.delete(table_key(key))
        return due

    def _retired_seen(self) -> dict[str, float]:
        """When this process first saw each retired shard whose retirement has no storage time."""
        seen: dict[str, float] | None = getattr(self, "_retired_first_seen", None)
        if seen is None:
            seen = {}
            self._retired_first_seen = seen
        return seen

    def _op_quarantine(self, event: dict[str, Any], *, content_ids: list[str], recheck: bool = False) -> list[str]:
        """Mark rows damaged. ``recheck`` (fsck's repair): each is read again where the index
        places it now, and one intact there is left alone: fsck's scan takes long, and a
        compaction meanwhile may have moved a row it read as gone (its old shard swept)."""
        damaged = sorted(set(content_ids))
        if recheck:
            with self.index.read() as t:
                blobs = {cid: t.get("blobs", cid.encode()) for cid in damaged}
            damaged = [cid for cid in damaged if (b := blobs[cid]) is not None and self._checked_row(cid, b) is None]
            if not damaged:
                return []
        event.update(kind="quarantine", content_ids=damaged)
        self._commit_event(event)
        return damaged

    def _stored_row(self, blob: dict[str, Any]) -> np.ndarray | None:
        """The bytes ``blob`` places, or None when there are none to use: quarantined, or its
        shard gone or short. (Publishing compares them with its own; maintenance hashes them.)"""
        if blob["state"] != "ok":
            return None
        row = empty_row(blob["length"])
        try:
            self.storage.read_into(blob["shard"], blob["offset"], memoryview(row.data))
        except BlobNotFound:
            return None
        return row

    def _checked_rows(self, items: list[tuple[str, dict[str, Any]]]) -> list[np.ndarray | None]:
        """:meth:`_checked_row` of each ``(cid, blob)``, each shard's rows read in one vectored read
        (on S3 its ranged GETs all in flight: one at a time, a sparse shard of a thousand small rows
        held every publish behind a thousand round trips)."""
        out: list[np.ndarray | None] = [None] * len(items)
        by_shard: dict[str, list[int]] = {}
        for i, (_, blob) in enumerate(items):
            if blob["state"] == "ok":
                by_shard.setdefault(blob["shard"], []).append(i)
        for shard, idx in by_shard.items():
            idx.sort(key=lambda i: items[i][1]["offset"])
            rows = [empty_row(items[i][1]["length"]) for i in idx]
            try:
                read_ranges_into(self.storage, shard, [(items[i][1]["offset"], items[i][1]["length"]) for i in idx],
                                 [memoryview(r.data) for r in rows])
            except BlobNotFound:  # the shard gone or short: which rows, one by one
                for i in idx:
                    out[i] = self._checked_row(*items[i])
                continue
            for i, row in zip(idx, rows, strict=True):
                cid, blob = items[i]
                out[i] = row if content_id(blob["layout_id"], row) == cid else None
        return out

    def _checked_row(self, cid: str, blob: dict[str, Any]) -> np.ndarray | None:
        """The row ``blob`` places, read and checked against ``cid`` in one pass; None when
        there is none to use (quarantined, its shard gone or short) or it is damaged."""
        if blob["state"] != "ok":
            return None
        row = empty_row(blob["length"])
        try:
            read_verified(self.storage, blob_location(cid, blob), row)
        except (BlobNotFound, IntegrityError):
            return None
        return row

    def _op_remove_orphans(self, event: dict[str, Any], *, keys: list[str]) -> list[str]:
        """Delete objects no index entry names (checked again here, where no write is in flight).

        Only shard objects and leftover temp files qualify; log objects are never deleted.
        Before any delete, a no-op event (a sweep of no shard) takes the next log seq: the
        writer before this one, paused after writing its shards and before its log object
        (its lease lost meanwhile), would otherwise commit that seq after its shards are gone,
        and be acknowledged. The create-only seq is what fences it: now it finds it taken.
        """
        removed = []
        with self.index.read() as t:
            for key in keys:
                is_shard = key.startswith("packs/") and "/rows/c/" in key and not key.endswith(".tmp")
                table_of = shard_of_table(key)  # a block table whose shard is gone is an orphan too
                if ((is_shard and t.get("shards", key.encode()) is None) or key.endswith(".tmp")
                        or (table_of is not None and t.get("shards", table_of.encode()) is None)):
                    removed.append(key)
        if removed:
            event.update(kind="sweep", shards=[])  # (every reader applies it: it deletes no shard)
            self._commit_event(event)
        for key in removed:
            self.storage.delete(key)
        return removed
