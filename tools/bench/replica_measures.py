"""The measures of tools/bench_replicas.py (lag, cold start, failover) for the suite's table."""

from __future__ import annotations

from typing import Any

from .measure import Measure

LAG_TARGET_MS = 1000.0  # p99 at the default poll interval
COLD_TARGET_S = 30.0  # at 10^6 adapters
FAILOVER_TARGET_TTLS = 2.0  # writer gone -> first accepted write on the standby, in lease TTLs


def replica_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    return [*_lag(r.get("lag", []), cmd), *_cold(r.get("cold_start", []), cmd),
            *_failover(r.get("failover", []), cmd)]


def _lag(rows: list[dict[str, Any]], cmd: str) -> list[Measure]:
    return [Measure(
        key=f"replicas.lag_p99_ms.r{row['replicas']}",
        title=f"replication lag p99 (publish acknowledged -> visible), {row['replicas']} replica(s)",
        ours=row["lag_p99_ms"], unit="ms", higher_is_better=False, target=f"<= {LAG_TARGET_MS:,.0f} ms",
        met=row["lag_p99_ms"] <= LAG_TARGET_MS, command=cmd,
        sizes=f"{row['publishes']} publishes on moto S3, poll every {row['poll_interval_s']:g} s, "
              f"p50 {row['lag_p50_ms']:g} ms, max {row['lag_max_ms']:g} ms") for row in rows]


def _cold(rows: list[dict[str, Any]], cmd: str) -> list[Measure]:
    out = []
    for row in rows:
        n = row["adapters"]
        big = n >= 10**6
        out.append(Measure(
            key=f"replicas.cold_start_s.n{n}", title=f"replica cold start, checkpoint + tail, {n:,} adapters",
            ours=row["cold_ckpt_s"], unit="s", baseline=row["cold_full_s"], baseline_label="full log replay",
            ratio=row["cold_full_s"] / row["cold_ckpt_s"] if row["cold_ckpt_s"] else None,
            higher_is_better=False, target=f"<= {COLD_TARGET_S:g} s" if big else "",
            met=(row["cold_ckpt_s"] <= COLD_TARGET_S) if big else None, command=cmd,
            sizes=f"{row['backend']}, {n:,} adapters in commits of {row['batch']:,}, then "
                  f"{row['tail_commits']} one-adapter commits after the checkpoint ({row['checkpoint_bytes']:,} B)"))
    return out


def _failover(rows: list[dict[str, Any]], cmd: str) -> list[Measure]:
    out = []
    for row in rows:
        ttl = row["lease_ttl_s"]
        honest = row["mode"] != "sigkill_same_host"  # same host: the lease sees the pid gone, no TTL wait
        how = ("writer SIGSTOPped: a silent holder, as a standby on another machine sees it" if honest else
               "writer SIGKILLed on the same host (pid shortcut: no TTL wait)")
        out.append(Measure(
            key=f"replicas.failover_s.{row['mode']}", title=f"failover to the standby, median, {how}",
            ours=row["median_s"], unit="s", higher_is_better=False,
            target=f"<= {FAILOVER_TARGET_TTLS:g}x TTL ({FAILOVER_TARGET_TTLS * ttl:g} s), worst trial" if honest
            else "", met=(row["max_s"] <= FAILOVER_TARGET_TTLS * ttl) if honest else None, command=cmd,
            sizes=f"{row['backend']}, lease TTL {ttl:g} s / renew {row['lease_renew_s']:g} s, "
                  f"{row['trials']} trials, max {row['max_s']:g} s ({row['max_over_ttl']:g}x TTL)"))
    return out
