"""fsck: every live row against its content id, every index location against storage, the
log against the index, and objects no index entry names. ``repair`` quarantines damaged
rows (their refs answer DamagedAdapter, never wrong bytes) and deletes orphans."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..errors import BlobNotFound, IntegrityError
from ..fleet.replica import read_store_id
from ..format.blocks import TABLE_PREFIX, shard_of_table
from ..index.checkpoint import checkpoint_problems
from ..index.commit_log import CommitLog, apply_event
from ..index.lmdb_index import Index
from ..index.queries import blob_location
from ..read.buffers import empty_row
from ..read.verified import read_verified
from ..store import Store

# databases whose contents are a pure function of the log (events and meta are bookkeeping)
_FOLDED_DBS = ("names", "versions", "tags", "blobs", "layouts", "shards", "bases")


@dataclass(slots=True)
class FsckReport:
    rows_checked: int = 0
    bytes_checked: int = 0
    damaged: list[dict[str, Any]] = field(default_factory=list)  # content_id, adapters, shard, reason
    # live rows quarantined (now or before): their versions answer DamagedAdapter until the same
    # bytes are published again or they are deleted. Known and harmless, so not "unclean", but
    # nothing fsck can do about them: listed in both modes (content_id, adapters, shard)
    held: list[dict[str, Any]] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    log_problems: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # multipart uploads older than the grace period: a write killed midway (key, upload_id, age_s)
    incomplete_uploads: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # their keys, aborted by --repair
    notes: list[str] = field(default_factory=list)  # what could not be checked (not problems found)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not (self.damaged or self.orphans or self.log_problems or self.incomplete_uploads)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"clean": self.clean}


_UPLOADED_IN_PARTS = ("packs/", "checkpoints/", "blocks/", "log/")  # what the store writes (large ones in parts)
UPLOAD_GRACE_S = 24 * 3600.0  # a multipart upload begun longer ago is no live writer's (a 16 GiB
# shard takes minutes): one a crash left, whose parts the object store keeps (and bills) forever


def fsck(store: Store, *, repair: bool = False, progress: bool = False, check_log: bool = True,
         upload_grace_s: float = UPLOAD_GRACE_S) -> FsckReport:
    """Check every live row against its content id, the log and checkpoints, and what lies in
    storage that nothing references (orphan objects, multipart uploads never completed);
    ``repair`` quarantines damaged rows, removes orphans and aborts those uploads."""
    report = FsckReport()
    with store.index_snapshot() as t:
        last_seq = t.last_seq
        blobs = [(k.decode(), v) for k, v in t.scan("blobs")]
        shard_keys = {k.decode() for k, _ in t.scan("shards")}
        adapters: dict[str, list[str]] = defaultdict(list)
        for _, rec in t.scan("versions"):
            if not rec["deleted"]:
                adapters[rec["content_id"]].append(f"{rec['tenant']}/{rec['name']}@{rec['version']}")
    if check_log:
        report.log_problems = _check_log(store, last_seq)
        # index checkpoints: hashes, decoding, and each equal to the log's fold at its seq
        report.log_problems += checkpoint_problems(store.storage, store_id=read_store_id(store.storage))
    objects = store.storage.list("")
    present = set(objects)
    report.orphans = [k for k in objects if _is_orphan(k, shard_keys)]
    now = time.time()
    try:  # only keys the store writes in parts (a store at a bucket's root lists everyone's uploads)
        report.incomplete_uploads = [{"key": k, "upload_id": u, "age_s": round(now - t, 1)}
                                     for k, u, t in store.storage.incomplete_uploads()
                                     if now - t > upload_grace_s and k.startswith(_UPLOADED_IN_PARTS)]
    except Exception as e:  # no permission to list them, a service without the call: the rest still runs
        report.notes.append(f"multipart uploads not checked: {e!r}")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(b["length"] for _, b in blobs if b["refs"] > 0), unit="B", unit_scale=True,
                   desc="fsck")
    for cid, blob in blobs:
        if blob["refs"] <= 0:
            continue
        reason = None
        if blob["state"] != "ok":
            reason = "quarantined"
        elif blob["shard"] not in present:
            reason = "shard missing"
        else:
            row = empty_row(blob["length"])
            try:
                read_verified(store.storage, blob_location(cid, blob), row)
            except IntegrityError:
                reason = "bytes do not match the content id"
            except BlobNotFound:
                reason = "shard shorter than the recorded location"
            report.rows_checked += 1
            report.bytes_checked += blob["length"]
        if reason == "quarantined":
            report.held.append({"content_id": cid, "adapters": sorted(adapters.get(cid, [])), "shard": blob["shard"]})
        elif reason is not None:
            report.damaged.append({"content_id": cid, "adapters": sorted(adapters.get(cid, [])),
                                   "shard": blob["shard"], "reason": reason})
        if bar is not None:
            bar.update(blob["length"])
    if bar is not None:
        bar.close()
    if repair:
        fresh = [d["content_id"] for d in report.damaged]
        if fresh:
            report.quarantined = store.quarantine(fresh, recheck=True)
        if report.orphans:
            report.removed = store.remove_orphans(report.orphans)
        left = []
        for u in report.incomplete_uploads:  # (a paused writer's later completion fails: nothing it acknowledged)
            try:
                store.storage.abort_upload(u["key"], u["upload_id"])
                report.aborted.append(u["key"])
            except Exception as e:
                report.notes.append(f"could not abort the upload of {u['key']}: {e!r}")
                left.append(u)
        report.incomplete_uploads = left
        report.repaired = True
        # what repair quarantined is held now; the rest was intact on the writer's second look (it
        # moved while the scan ran): not damaged
        done = set(report.quarantined)
        report.held += [{k: d[k] for k in ("content_id", "adapters", "shard")}
                        for d in report.damaged if d["content_id"] in done]
        report.damaged = []
        report.orphans = [k for k in report.orphans if k not in set(report.removed)]
    return report


def orphan_shards(store: Store) -> list[str]:
    """Shard objects and block tables that no index entry names: what a commit that failed or
    was fenced after writing its shards left (temp files are left to ``fsck --repair``: a
    checkpoint being written has one). Pass them to :meth:`Store.remove_orphans`, which checks
    again on the writer thread and fences a paused earlier writer before deleting anything."""
    with store.index_snapshot() as t:
        shard_keys = {k.decode() for k, _ in t.scan("shards")}
    keys = store.storage.list("packs/") + store.storage.list(TABLE_PREFIX)
    return [k for k in keys if not k.endswith(".tmp") and _is_orphan(k, shard_keys)]


def _is_orphan(key: str, shard_keys: set[str]) -> bool:
    if key.endswith(".tmp"):  # the store's own temp files (another program's dot-files are not its orphans)
        return True
    if key.startswith("packs/") and "/rows/c/" in key:
        return key not in shard_keys
    table_of = shard_of_table(key)  # a block table (mint_store.format.blocks) lives as long as its shard
    return table_of is not None and table_of not in shard_keys


def _check_log(store: Store, last_seq: int) -> list[str]:
    """The log is contiguous, the index folded all of it, and folding it again gives the index."""
    problems: list[str] = []
    log = CommitLog(store.storage)
    seqs = sorted(log.all_seqs())
    if seqs != list(range(1, len(seqs) + 1)):
        missing = sorted(set(range(1, (seqs[-1] if seqs else 0) + 1)) - set(seqs))
        problems.append(f"log objects missing: seqs {missing[:20]}")
    if (seqs[-1] if seqs else 0) != last_seq:
        problems.append(f"the index is at seq {last_seq}, the log at {seqs[-1] if seqs else 0}")
    if problems:
        return problems
    tmp = tempfile.mkdtemp(prefix="mint-fsck-")
    try:
        fold = Index.acquire(os.path.join(tmp, "db"))
        try:
            for seq in seqs:
                event = log.read(seq)
                if event is None:
                    problems.append(f"log object {seq} vanished")
                    return problems
                with fold.write() as w:
                    apply_event(w, event)
            with fold.read() as a, store.index_snapshot() as b:
                for db in _FOLDED_DBS:
                    ours, theirs = dict(a.scan(db)), dict(b.scan(db))
                    if ours != theirs:
                        diff = sorted(set(ours) ^ set(theirs)) or sorted(k for k in ours if ours[k] != theirs.get(k))
                        problems.append(f"index db {db!r} disagrees with the log at {[k.decode() for k in diff[:5]]}")
        finally:
            fold.release()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return problems
