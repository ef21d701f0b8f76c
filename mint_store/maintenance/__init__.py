"""Keeping a store healthy and reporting on it: compaction, sweep, fsck, reindex,
statistics and the console's catalog summaries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .catalog import adapter_summaries
    from .compaction import CompactionPolicy, CompactionReport, compact
    from .fsck import FsckReport
    from .reindex import ReindexReport, rebuild_index
    from .stats import store_stats
    from .writer_ops import WriterMaintenance

_EXPORTS = {
    "CompactionPolicy": ".compaction",
    "CompactionReport": ".compaction",
    "FsckReport": ".fsck",
    "ReindexReport": ".reindex",
    "WriterMaintenance": ".writer_ops",
    "adapter_summaries": ".catalog",
    "compact": ".compaction",
    "rebuild_index": ".reindex",
    "store_stats": ".stats",
}

__all__ = [
    "CompactionPolicy",
    "CompactionReport",
    "FsckReport",
    "ReindexReport",
    "WriterMaintenance",
    "adapter_summaries",
    "compact",
    "rebuild_index",
    "store_stats",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
