"""What a replica did, and whether it is following the log (``/healthz``, ``/metrics``, tests).

A replica is *following* unless one of two things holds, each named by a short fixed reason
code that ``/healthz`` shows to anyone (the details -- seqs, error text -- go to admins only):

- ``log_gap``: the log has no object at the seq after the replica's position but holds later
  ones, for more than :data:`GAP_POLLS` polls in a row, and no checkpoint covers the hole;
- ``not_following``: :data:`FAILURES_DEGRADED` polls in a row failed (storage errors, an
  unreadable log object).

Both clear by themselves at the first poll that gets past them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("mint.replica")

# Polls a gap is waited on before it is reported. The writer creates seq N+1 before it plans
# N+2, so a gap a GET confirms is an object that is gone, or a store that answers late after a
# create (listing or negative caches): a few polls cover the latter.
GAP_POLLS = 25
FAILURES_DEGRADED = 3  # failed polls in a row before a replica says it is not following
FOREIGN_NAMES_KEPT = 1024  # distinct foreign keys remembered (and counted); past that, counted as this many
LOG_GAP = "log_gap"
NOT_FOLLOWING = "not_following"


@dataclass(slots=True)
class ReplicaStats:
    """What a replica did, for tests, benchmarks and ``/healthz``."""

    checkpoint_seq: int | None = None  # the checkpoint the index was built from
    rejected_checkpoints: list[str] = field(default_factory=list)
    log_objects_read: int = 0
    lists: int = 0
    reloads: int = 0  # rebuilds from a checkpoint after the log was compacted past us
    last_seq: int = 0
    last_poll: float | None = None
    last_error: str | None = None
    failures: int = 0  # polls in a row that raised
    failing_since: float | None = None  # when the first of them raised
    foreign_log_objects: int = 0  # distinct keys in log/ that are no log object (skipped)
    gap: dict[str, Any] | None = None  # {"after", "next", "since", "polls"} while the log has a hole
    rejected_seqs: set[int] = field(default_factory=set, repr=False)  # never retried by a follower
    _foreign: set[str] = field(default_factory=set, repr=False)

    def note_foreign(self, keys: list[str]) -> None:
        """Count foreign keys (each once); the first sighting of each is logged."""
        for key in keys:
            if key in self._foreign or len(self._foreign) >= FOREIGN_NAMES_KEPT:
                continue
            self._foreign.add(key)
            log.warning("%s is not a log object (the writer names them log/<20 digits>.json): skipped. "
                        "Move it out of log/", key)
        self.foreign_log_objects = len(self._foreign)

    def note_gap(self, after: int, next_seq: int) -> int:
        """One more poll that met the gap after seq ``after``; returns the polls it was met in."""
        gap = self.gap  # one read: two pollers (a follower, a standby's refresh) may share these stats
        if gap is None or gap["after"] != after:
            gap = self.gap = {"after": after, "next": next_seq, "since": time.time(), "polls": 0}
        gap["polls"] += 1
        gap["next"] = next_seq
        return int(gap["polls"])

    def clear_gap(self) -> None:
        self.gap = None

    def poll_failed(self, e: BaseException) -> None:
        if not self.failures:
            self.failing_since = time.time()
        self.failures += 1
        self.last_error = repr(e)

    def poll_succeeded(self) -> None:
        self.failures, self.failing_since, self.last_error = 0, None, None

    @property
    def reason(self) -> str | None:
        """None while following; else a short fixed code (``log_gap``, ``not_following``)."""
        return _reason(self.gap, self.failures)  # one read of each: a poller may change them meanwhile

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("rejected_seqs", "_foreign")}
        gap = out["gap"] = dict(out["gap"]) if out["gap"] is not None else None
        out["rejected_checkpoints"] = list(self.rejected_checkpoints)
        out["reason"] = reason = _reason(gap, out["failures"])
        out["following"] = reason is None
        out["since"] = (gap["since"] if reason == LOG_GAP and gap is not None
                        else out["failing_since"] if reason == NOT_FOLLOWING else None)
        return out


def _reason(gap: dict[str, Any] | None, failures: int) -> str | None:
    if gap is not None and gap["polls"] > GAP_POLLS:
        return LOG_GAP
    if failures >= FAILURES_DEGRADED:
        return NOT_FOLLOWING
    return None
