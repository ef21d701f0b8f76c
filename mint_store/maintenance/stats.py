"""Store statistics: adapters, versions, layouts, shards (live ratio histogram), bytes."""

from __future__ import annotations

from typing import Any

from ..store import Store


def store_stats(store: Store) -> dict[str, Any]:
    hist = [0] * 10  # live ratio of shards, by tenth
    live_bytes = dead_bytes = logical_bytes = 0
    with store.index_snapshot() as t:
        names = t.count("names")
        versions = live_versions = 0
        for _, rec in t.scan("versions"):
            versions += 1
            if not rec["deleted"]:
                live_versions += 1
                logical_bytes += rec["nbytes"]
        blobs = damaged = 0
        for _, blob in t.scan("blobs"):
            blobs += 1
            damaged += blob["state"] != "ok"
            if blob["refs"] > 0:
                live_bytes += blob["length"]
            else:
                dead_bytes += blob["length"]
        shards = retired = 0
        for _, rec in t.scan("shards"):
            if rec.get("retired_at") is not None:
                retired += 1
                continue
            shards += 1
            ratio = rec["live"] / rec["total"] if rec["total"] else 0.0
            hist[min(9, int(ratio * 10))] += 1
        return {
            "tenants": len(store.tenants()),
            "adapters": names,
            "versions": versions,
            "live_versions": live_versions,
            "layouts": t.count("layouts"),
            "rows": blobs,
            "damaged_rows": damaged,
            "shards": shards,
            "retired_shards": retired,
            "live_ratio_histogram": {f"{i / 10:.1f}-{(i + 1) / 10:.1f}": n for i, n in enumerate(hist)},
            "bytes_live": live_bytes,
            "bytes_dead": dead_bytes,
            "bytes_logical": logical_bytes,
            "dedup_savings_bytes": logical_bytes - live_bytes,
            "index_bytes": store.index_bytes(),
            "last_seq": t.last_seq,
        }
