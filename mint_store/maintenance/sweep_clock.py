"""When a retired shard's grace period began, on clocks the reader trusts.

A compact event records ``time``, but that field is data read back from storage: a planted
event saying ``"time": 0`` would make a sweep delete its shards at once. So the sweep measures
the grace period from the storage's own timestamp of the log object that retired the shard
(a local file's mtime, S3's ``Last-Modified``: set by the storage when the object was written,
not by what the object says), compared with the sweeping process's clock. Where the storage
gives none (the log object gone, a backend without timestamps), from when this process first
saw the shard retired: never earlier than the storage or this process could prove.
"""

from __future__ import annotations

from ..index.commit_log import log_key
from ..index.lmdb_index import Txn
from ..storage import Storage


def retiring_seqs(t: Txn, keys: list[str]) -> dict[str, int]:
    """The seq of the compact event that retired each of ``keys`` (those the change feed names),
    newest events first: shards awaiting a sweep were retired recently, so the scan stops early."""
    want, out = set(keys), dict[str, int]()
    if not want:
        return out
    for _, summary in t.scan_back("events", b""):
        if isinstance(summary, dict) and summary.get("kind") == "compact":
            for key in summary.get("retired") or ():
                if key in want and key not in out:
                    out[key] = int(summary["seq"])
            if len(out) == len(want):
                break
    return out


def retired_since(t: Txn, storage: Storage, keys: list[str], *, now: float,
                  first_seen: dict[str, float]) -> dict[str, float]:
    """For each of ``keys`` (retired shards), the time its grace period runs from.

    ``first_seen`` is the caller's own record of when it first saw a shard retired (updated
    here); it is used where the storage has no timestamp for the retiring log object.
    """
    seqs = retiring_seqs(t, keys)
    stamps: dict[int, float | None] = {}
    out: dict[str, float] = {}
    for key in keys:
        first = first_seen.setdefault(key, now)
        seq = seqs.get(key)
        if seq is not None and seq not in stamps:
            stamps[seq] = storage.modified(log_key(seq))
        stamp = stamps.get(seq) if seq is not None else None
        out[key] = stamp if stamp is not None else first
    for gone in set(first_seen) - set(keys):  # swept (or never retired): forget it
        del first_seen[gone]
    return out
