"""The write path: a publish is queued, group-committed by the one writer thread in crash-safe order,
under the index directory's lock and the store's writer lease; recovery after a failed commit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .lease import LeaseWatch, WriterLease
    from .lock import WriterLock
    from .queue import PendingPublish, WriteOp
    from .recovery import WriterHealth, WriterRecovery
    from .writer import Writer

_EXPORTS = {
    "LeaseWatch": ".lease",
    "PendingPublish": ".queue",
    "WriteOp": ".queue",
    "Writer": ".writer",
    "WriterHealth": ".recovery",
    "WriterLease": ".lease",
    "WriterLock": ".lock",
    "WriterRecovery": ".recovery",
}

__all__ = [
    "LeaseWatch",
    "PendingPublish",
    "WriteOp",
    "Writer",
    "WriterHealth",
    "WriterLease",
    "WriterLock",
    "WriterRecovery",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
