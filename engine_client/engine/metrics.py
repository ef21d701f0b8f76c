"""Hit counts, bytes and latency per cache tier.

Tiers, fastest first: ``device`` (the adapter already sat in a slot), ``host`` (its row
was in the pinned host cache), ``storage`` (one read from the store). Every adapter an
engine needs is counted once, in the tier that served it. Latencies are kept in a bounded
window per tier, so percentiles describe recent traffic.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

TIERS = ("device", "host", "storage")


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    count: int = 0
    bytes: int = 0
    p50_s: float = 0.0
    p90_s: float = 0.0
    p99_s: float = 0.0
    mean_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSnapshot:
    tiers: dict[str, TierStats] = field(default_factory=dict)
    cancelled: int = 0
    errors: int = 0

    @property
    def lookups(self) -> int:
        return sum(t.count for t in self.tiers.values())

    def hit_rate(self, tier: str) -> float:
        """Share of lookups served by ``tier`` (0.0 with no lookups yet)."""
        n = self.lookups
        return self.tiers[tier].count / n if n else 0.0

    def table(self) -> str:
        lines = [f"{'tier':8} {'count':>8} {'share':>6} {'MiB':>9} {'p50 us':>9} {'p99 us':>9}"]
        for name, t in self.tiers.items():
            lines.append(
                f"{name:8} {t.count:8d} {self.hit_rate(name):6.1%} {t.bytes / 2**20:9.2f} "
                f"{t.p50_s * 1e6:9.1f} {t.p99_s * 1e6:9.1f}"
            )
        return "\n".join(lines)


class Metrics:
    """Thread-safe counters: the streamer records on its loop, the engine on its thread."""

    def __init__(self, *, window: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._count = dict.fromkeys(TIERS, 0)
        self._bytes = dict.fromkeys(TIERS, 0)
        self._lat: dict[str, deque[float]] = {t: deque(maxlen=window) for t in TIERS}
        self._cancelled = 0
        self._errors = 0

    def record(self, tier: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._count[tier] += 1
            self._bytes[tier] += nbytes
            self._lat[tier].append(seconds)

    def cancelled(self) -> None:
        with self._lock:
            self._cancelled += 1

    def error(self) -> None:
        with self._lock:
            self._errors += 1

    def count(self, tier: str) -> int:
        return self._count[tier]

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            lat = {t: np.fromiter(self._lat[t], dtype=np.float64) for t in TIERS}
            tiers = {}
            for t in TIERS:
                q = np.percentile(lat[t], [50, 90, 99]) if lat[t].size else np.zeros(3)
                tiers[t] = TierStats(
                    count=self._count[t], bytes=self._bytes[t], p50_s=float(q[0]), p90_s=float(q[1]),
                    p99_s=float(q[2]), mean_s=float(lat[t].mean()) if lat[t].size else 0.0,
                )
            return MetricsSnapshot(tiers=tiers, cancelled=self._cancelled, errors=self._errors)
