"""Rebuild the LMDB index from the commit log and the packs, then swap it in."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

from ..errors import IndexFormatMismatch, IntegrityError
from ..format.layout import Layout
from ..format.packs import Pack, PackGeometry
from ..index.commit_log import CommitLog, apply_event
from ..index.lmdb_index import Index, finish_swap, index_db_path
from ..storage import Storage
from ..write.lock import WriterLock

log = logging.getLogger("mint.index")


@dataclass(frozen=True, slots=True)
class ReindexReport:
    events: int
    layouts: int
    shards: int
    blobs: int

    def to_dict(self) -> dict[str, Any]:
        return {"events": self.events, "layouts": self.layouts, "shards": self.shards, "blobs": self.blobs}


def rebuild_index(storage: Storage, index_dir: str, *, check_packs: bool = True) -> ReindexReport:
    """Fold every log object into a new index in ``<index_dir>/db.new`` and swap it in.

    Takes the writer lock: run it with no writer open on this index. With
    ``check_packs`` every shard the log names must exist, its layout must match the
    pack's Zarr attributes, and every recorded byte offset must agree with the shard's
    own index -- so the rebuilt index never points at nothing.
    """
    lock = WriterLock(index_dir)
    lock.acquire()
    try:
        return rebuild_under_lock(storage, index_dir, check_packs=check_packs)
    finally:
        lock.release()


def rebuild_under_lock(storage: Storage, index_dir: str, *, check_packs: bool = True) -> ReindexReport:
    """:func:`rebuild_index` for a caller that already holds the writer lock of ``index_dir``."""
    finish_swap(index_dir)
    new = os.path.join(index_dir, "db.new")
    if os.path.exists(new):
        shutil.rmtree(new)
    log = CommitLog(storage)
    seqs = sorted(log.all_seqs())
    if seqs != list(range(1, len(seqs) + 1)):
        missing = sorted(set(range(1, (seqs[-1] if seqs else 0) + 1)) - set(seqs))
        raise IntegrityError(f"the commit log has gaps (missing seqs {missing[:10]}); cannot rebuild")
    index = Index.acquire(new)
    try:
        for seq in seqs:
            event = log.read(seq)
            if event is None:
                raise IntegrityError(f"log object {seq} vanished during reindex")
            with index.write() as w:
                apply_event(w, event)
        with index.read() as t:
            layouts = list(t.scan("layouts"))
            shards = list(t.scan("shards"))
            blobs = list(t.scan("blobs"))
        if check_packs:
            _check_packs(storage, layouts, blobs)
    finally:
        index.release()
    db, old = index_db_path(index_dir), os.path.join(index_dir, "db.old")
    if os.path.exists(db):
        os.rename(db, old)
    os.rename(new, db)
    shutil.rmtree(old, ignore_errors=True)
    return ReindexReport(len(seqs), len(layouts), len(shards), len(blobs))


def _check_packs(storage: Storage, layouts: list[tuple[bytes, Any]], blobs: list[tuple[bytes, Any]]) -> None:
    import zarr

    zstore = storage.zarr_store()
    by_layout: dict[str, Pack] = {}
    for key, rec in layouts:
        layout = Layout.from_dict(rec["layout"])
        group = zarr.open_group(zstore, path=f"packs/{key.decode()}", mode="r")
        if group.attrs.get("layout") != layout.to_dict():
            raise IntegrityError(f"pack {key.decode()} has a layout that disagrees with the log")
        geometry = PackGeometry(layout.row_nbytes, rec["rows_per_shard"], rec["chunk_cols"])
        by_layout[key.decode()] = Pack(storage, layout, geometry, None)
    offsets: dict[str, list[int]] = {}
    for cid, blob in blobs:
        if blob.get("state", "ok") != "ok":  # quarantined (fsck found its shard gone or short): known, and
            continue  # refused by every read; checking it would block the rebuild fsck prescribes
        shard = blob["shard"]
        if shard not in offsets:
            if not storage.exists(shard):
                raise IntegrityError(f"shard {shard} named by the log is missing (content id {cid.decode()})")
            offsets[shard] = by_layout[blob["layout_id"]].row_offsets(shard)
        local = blob["row"] % by_layout[blob["layout_id"]].geometry.rows_per_shard
        if offsets[shard][local] != blob["offset"]:
            raise IntegrityError(f"content id {cid.decode()}: shard {shard} holds it at another offset")


def open_writable_index(storage: Storage, index_dir: str) -> Index:
    """The writable index; one of an older format (pickled records) is rebuilt from the log."""
    try:
        return Index.acquire(index_db_path(index_dir))
    except IndexFormatMismatch as e:
        log.warning("%s: rebuilding it from the commit log (its records are not read)", e)
        # the old index was the fold of the log, unchecked; so is this one (fsck checks the packs)
        report = rebuild_under_lock(storage, index_dir, check_packs=False)
        log.warning("index %s rebuilt from %d log objects", index_dir, report.events)
        return Index.acquire(index_db_path(index_dir))
