"""Listing the commit log after a position: a follower's one LIST per poll.

Only keys under the writer's grammar (``log/<20 digits>.json``, :func:`~mint_store.index.commit_log.seq_of_key`)
are log objects. Anything else in ``log/`` -- a backup copy (``log/backup-1.json``), an editor's
file, a nested key -- is *foreign*: it is skipped and returned in :attr:`LogListing.foreign` so
that the follower counts it, and it never stops or rewinds following. A local store's temp files
of a write in progress (``log/.<name>.<uuid>.tmp``) are neither.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import IntegrityError
from ..storage import FsspecStorage, LocalStorage, Storage
from .commit_log import LOG_PREFIX, is_temp_key, log_key, seq_of_key

LIST_PAGE = 1000
# S3 pages of foreign keys only, in a row, one listing walks past before it gives up: with
# StartAfter, foreign keys that sort after the head (``log/backup-1.json`` sorts after every
# digit) come back at every poll, so a few cost a poll nothing; thousands must be moved away
FOREIGN_PAGES = 16


@dataclass(slots=True)
class LogListing:
    """Log seqs after a position (in order, at most a page) and the foreign keys met on the way."""

    seqs: list[int] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    full: bool = False  # the page was full: more log objects may follow

    def __len__(self) -> int:
        return len(self.seqs)


def _split(keys: list[str], seq: int, limit: int) -> LogListing:
    out = LogListing()
    for key in sorted(keys):
        s = seq_of_key(key)
        if s is None:
            if not is_temp_key(key):
                out.foreign.append(key)
        elif s > seq and len(out.seqs) < limit:
            out.seqs.append(s)
        elif s > seq:
            out.full = True
    return out


def list_log_after(storage: Storage, seq: int, *, limit: int = LIST_PAGE) -> LogListing:
    """Seqs of log objects after ``seq``, in order, at most ``limit``: one LIST request (S3: more
    only while its pages hold foreign keys alone), plus the foreign keys it met."""
    if isinstance(storage, LocalStorage):
        try:
            names = os.listdir(storage.root / LOG_PREFIX)
        except FileNotFoundError:
            return LogListing()
        return _split([LOG_PREFIX + n for n in names], seq, limit)
    if isinstance(storage, FsspecStorage) and hasattr(storage.fs, "_call_s3"):
        return _s3_list_after(storage, seq, limit)
    return _split(storage.list(LOG_PREFIX), seq, limit)


def _s3_list_after(storage: FsspecStorage, seq: int, limit: int) -> LogListing:
    bucket, root, _ = storage.fs.split_path(storage._root + "/")
    root = root.rstrip("/") + "/" if root.strip("/") else ""
    out = LogListing()
    args: dict[str, Any] = {"Bucket": bucket, "Prefix": root + LOG_PREFIX, "StartAfter": root + log_key(seq),
                            "MaxKeys": limit}
    for _ in range(FOREIGN_PAGES):
        resp = storage._s3_call("list_objects_v2", **args)
        page = _split([c["Key"][len(root):] for c in resp.get("Contents", [])], seq, limit)
        out.seqs += page.seqs
        out.foreign += page.foreign
        out.full = bool(resp.get("IsTruncated"))
        if out.seqs or not out.full:
            return out
        args = {**args, "ContinuationToken": resp["NextContinuationToken"]}
    raise IntegrityError(f"{storage.url}: {FOREIGN_PAGES} pages of objects in {LOG_PREFIX} after {log_key(seq)} "
                         f"are no log objects (e.g. {out.foreign[0]}): this replica cannot find the log "
                         f"past seq {seq}. Move what is not <20 digits>.json out of {LOG_PREFIX}")
