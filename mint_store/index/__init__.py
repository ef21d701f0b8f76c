"""The commit log (one immutable object per commit) and the LMDB index materialised from it:
lookups, checkpoints of the index, and listing the log after a position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .checkpoint import Checkpointer
    from .commit_log import CommitLog, apply_event
    from .lmdb_index import Index
    from .log_listing import LogListing, list_log_after
    from .queries import resolve_in, version_record

_EXPORTS = {
    "Checkpointer": ".checkpoint",
    "CommitLog": ".commit_log",
    "Index": ".lmdb_index",
    "LogListing": ".log_listing",
    "apply_event": ".commit_log",
    "list_log_after": ".log_listing",
    "resolve_in": ".queries",
    "version_record": ".queries",
}

__all__ = [
    "Checkpointer",
    "CommitLog",
    "Index",
    "LogListing",
    "apply_event",
    "list_log_after",
    "resolve_in",
    "version_record",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
