"""Compaction: rewrite the live rows of sparse or small shards into full new shards.

Each step is one writer operation (serialised with publishes): read the live rows
(verified), write them as new shards, then one log entry and one index transaction
switch their locations and retire the old shards. Retired shards stay readable for a
grace period, so an engine holding an old location keeps reading valid bytes; a sweep
deletes them afterwards (an engine that then gets "not found" re-resolves once).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from ..store import Store

DEFAULT_GRACE_S = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionPolicy:
    min_live_ratio: float = 0.5  # shards whose live/total is below this are rewritten
    small_fill_ratio: float = 0.5  # a shard with fewer rows than this share of its capacity is small
    min_small_shards: int = 2  # small shards of a layout are merged once there are this many
    max_step_bytes: int = 256 * 2**20  # live bytes moved per writer operation
    grace_s: float = DEFAULT_GRACE_S

    def __post_init__(self) -> None:
        if not 0 <= self.min_live_ratio <= 1 or not 0 <= self.small_fill_ratio <= 1:
            raise ValueError("ratios must be within [0, 1]")
        if self.min_small_shards < 1 or self.max_step_bytes < 1 or self.grace_s < 0:
            raise ValueError("min_small_shards and max_step_bytes must be positive, grace_s >= 0")


@dataclass(frozen=True, slots=True)
class CompactionStep:
    layout_id: str
    shards: tuple[str, ...]
    content_ids: tuple[str, ...]
    live_bytes: int


@dataclass(slots=True)
class CompactionReport:
    shards_before: int = 0
    shards_after: int = 0
    rows_moved: int = 0
    rows_dropped: int = 0
    bytes_moved: int = 0
    bytes_reclaimable: int = 0
    shards_retired: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def plan(store: Store, policy: CompactionPolicy) -> list[CompactionStep]:
    """Choose shards by live ratio and small-shard count per layout, in bounded steps."""
    with store.index_snapshot() as t:
        capacity = {k.decode(): rec["rows_per_shard"] for k, rec in t.scan("layouts")}
        row_bytes = {k.decode(): rec["layout"]["row_nbytes"] for k, rec in t.scan("layouts")}
        by_layout: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
        # shards whose rows were all written again elsewhere (a damaged or lost row healed by a
        # republish of its bytes): nothing to move, retired by the step so the sweep frees them
        empty: dict[str, set[str]] = defaultdict(set)
        for k, rec in t.scan("shards"):
            if rec.get("retired_at") is None:
                if rec["total"] > 0:
                    by_layout[rec["layout_id"]].append((k.decode(), rec))
                else:
                    empty[rec["layout_id"]].add(k.decode())
        candidates: dict[str, tuple[set[str], set[str]]] = {}  # layout -> (sparse, small)
        for layout_id, shards in by_layout.items():
            cap = capacity[layout_id]
            sparse = {k for k, r in shards if r["live"] < policy.min_live_ratio * r["total"]}
            small = {k for k, r in shards if r["total"] < policy.small_fill_ratio * cap and k not in sparse}
            if sparse or small:
                candidates[layout_id] = (sparse, small)
        considered = {k for sparse, small in candidates.values() for k in sparse | small} | {
            k for ks in empty.values() for k in ks}
        rows: dict[str, list[tuple[str, bool]]] = defaultdict(list)
        stuck: set[str] = set()  # live rows, none of them movable (quarantined): nothing a step could do
        movable: dict[str, int] = defaultdict(int)
        if considered:
            for cid, blob in t.scan("blobs"):  # one pass: the index has no shard -> rows map
                if blob["shard"] in considered:
                    rows[blob["shard"]].append((cid.decode(), blob["refs"] > 0))
                    movable[blob["shard"]] += blob["refs"] > 0 and blob.get("state", "ok") == "ok"
            stuck = {k for k in considered if movable[k] == 0 and any(live for _, live in rows[k])}
        chosen: dict[str, set[str]] = {}
        for layout_id, (sparse, small) in candidates.items():
            # a shard kept for its quarantined rows stays small: counted, it paired with the shard the
            # good rows were just moved into, and every pass rewrote those rows again, for good
            sparse, small = sparse - stuck, small - stuck
            pick = sparse | (small if len(small) >= policy.min_small_shards else set())
            if pick and not (len(pick) == 1 and pick <= small):  # one small shard alone gains nothing
                chosen[layout_id] = pick
        for layout_id, keys in empty.items():
            chosen.setdefault(layout_id, set()).update(keys)
        if not chosen:
            return []
    steps: list[CompactionStep] = []
    for layout_id, keys in chosen.items():
        batch_keys: list[str] = []
        batch_cids: list[str] = []
        live = 0
        for key in sorted(keys):
            n_live = sum(1 for _, is_live in rows[key] if is_live)
            if batch_keys and live + n_live * row_bytes[layout_id] > policy.max_step_bytes:
                steps.append(CompactionStep(layout_id, tuple(batch_keys), tuple(batch_cids), live))
                batch_keys, batch_cids, live = [], [], 0
            batch_keys.append(key)
            batch_cids.extend(cid for cid, _ in rows[key])
            live += n_live * row_bytes[layout_id]
        steps.append(CompactionStep(layout_id, tuple(batch_keys), tuple(batch_cids), live))
    return steps


def count_shards(store: Store) -> int:
    with store.index_snapshot() as t:
        return sum(1 for _, rec in t.scan("shards") if rec.get("retired_at") is None)


def compact(store: Store, policy: CompactionPolicy | None = None, *, progress: bool = False) -> CompactionReport:
    """Run every planned step; returns what moved. Safe while publishers write and engines read."""
    policy = policy or CompactionPolicy()
    report = CompactionReport(shards_before=count_shards(store))
    start = time.perf_counter()
    steps = plan(store, policy)
    bar = _progress(steps, progress)
    for step in steps:
        out = store.compact_shards(step.layout_id, list(step.shards), list(step.content_ids))
        report.rows_moved += out["moved"]
        report.rows_dropped += out["dropped"]
        report.bytes_moved += out["bytes_moved"]
        report.shards_retired.extend(out["retired"])
        report.damaged.extend(out["damaged"])
        if bar is not None:
            bar.update(out["bytes_moved"])
            bar.set_postfix(rows=report.rows_moved, retired=len(report.shards_retired))
    if bar is not None:
        bar.close()
    report.shards_after = count_shards(store)
    report.bytes_reclaimable = _retired_bytes(store, report.shards_retired)
    report.seconds = time.perf_counter() - start
    return report


def _retired_bytes(store: Store, keys: list[str]) -> int:
    total = 0
    for key in keys:
        try:
            total += store.storage.size(key)
        except KeyError:
            pass
    return total


def _progress(steps: list[CompactionStep], enabled: bool) -> Any:
    if not enabled or not steps:
        return None
    from tqdm import tqdm

    return tqdm(total=sum(s.live_bytes for s in steps), unit="B", unit_scale=True, desc="compact")
