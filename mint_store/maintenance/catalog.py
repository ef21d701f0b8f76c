"""Read-only summaries for people (the web console): one row per adapter, compaction state."""

from __future__ import annotations

import itertools
from typing import Any

from ..format.names import check_name
from ..store import Store
from .compaction import CompactionPolicy, plan

# how far back the compaction state looks for the last compact/sweep event (bounds the scan)
_EVENTS_LOOKBACK = 10_000


def adapter_summaries(store: Store, tenant: str, *, prefix: str = "", after: str | None = None,
                      limit: int = 100) -> list[dict[str, Any]]:
    """One row per adapter of ``tenant`` (in name order, like ``Store.names``), from one read.

    Each row: ``name``, ``latest`` (the newest live version, None when every version is
    deleted), ``versions`` (live) and ``total_versions``, ``tags`` ({tag: version}), and of
    the latest live version ``base``, ``rank`` (the config's ``r``), ``nbytes``,
    ``content_id``; ``updated`` is the creation time of the newest version (the last publish).
    """
    check_name(tenant, "tenant")
    start = f"{tenant}/{after}\x00".encode() if after else None
    rows: list[dict[str, Any]] = []
    with store.index_snapshot() as t:
        for key, _ in itertools.islice(t.scan("names", f"{tenant}/{prefix}".encode(), start), limit):
            name = key.decode().split("/", 1)[1]
            recs = [rec for _, rec in t.scan("versions", f"{tenant}/{name}@".encode())]
            live = [rec for rec in recs if not rec["deleted"]]
            latest = live[-1] if live else None
            config = (latest or {}).get("peft_config") or {}
            rank = config.get("r") if isinstance(config, dict) else None
            rows.append({
                "name": name,
                "latest": latest["version"] if latest else None,
                "versions": len(live),
                "total_versions": len(recs),
                "tags": {k.decode().rsplit(":", 1)[1]: v["version"]
                         for k, v in t.scan("tags", f"{tenant}/{name}:".encode())},
                "base": latest["base"] if latest else None,
                "rank": rank if isinstance(rank, int) else None,
                "nbytes": latest["nbytes"] if latest else None,
                "content_id": latest["content_id"] if latest else None,
                "updated": max((rec["created"] for rec in recs), default=None),
            })
    return rows


def compaction_state(store: Store, policy: CompactionPolicy | None = None) -> dict[str, Any]:
    """What a compaction would do now, what waits for the sweep, and when either last ran."""
    steps = plan(store, policy or CompactionPolicy())
    with store.index_snapshot() as t:
        retired = [rec["retired_at"] for _, rec in t.scan("shards") if rec.get("retired_at") is not None]
        last: dict[str, Any] = {"compact": None, "sweep": None}
        for _, ev in itertools.islice(t.scan_back("events", b""), _EVENTS_LOOKBACK):
            kind = ev.get("kind")
            if kind in last and last[kind] is None:
                last[kind] = {"seq": ev["seq"], "time": ev["time"]}
                if all(last.values()):
                    break
    return {
        "pending_steps": len(steps),
        "pending_shards": sum(len(s.shards) for s in steps),
        "pending_rows": sum(len(s.content_ids) for s in steps),
        "pending_live_bytes": sum(s.live_bytes for s in steps),
        "retired_shards": len(retired),
        "oldest_retired_at": min(retired, default=None),
        "last_compaction": last["compact"],
        "last_sweep": last["sweep"],
    }
