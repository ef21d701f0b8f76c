"""What runs only in a fleet on one bucket: read replicas following the log, their stats,
and a standby writer that takes the lease when its holder stops renewing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .replica import Follower, open_replica_index
    from .replica_stats import ReplicaStats
    from .standby import Standby, open_standby

_EXPORTS = {
    "Follower": ".replica",
    "ReplicaStats": ".replica_stats",
    "Standby": ".standby",
    "open_replica_index": ".replica",
    "open_standby": ".standby",
}

__all__ = [
    "Follower",
    "ReplicaStats",
    "Standby",
    "open_replica_index",
    "open_standby",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
