"""The measures of tools/bench_s3_read.py (a large row on S3 in parallel ranged GETs) for the suite's table."""

from __future__ import annotations

from typing import Any

from .measure import Measure

MiB = 2**20
VS_ONE_GET = 1.0  # parallel ranged GETs must not be slower than one GET of the row
VS_RAW = 0.9  # read_row (copy into the buffer, verified) within 10% of the same GETs through s3fs alone


def s3read_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    mib = round(r["row_nbytes"] / MiB)
    probe = r["server_probe"]
    sizes = (f"one {r['row_nbytes']:,} B row, {r['gets_per_parallel_read']} GETs of <= "
             f"{r['read_part_bytes'] / MiB:g} MiB, {r['read_concurrency']} at once; medians of "
             f"{r['config']['rounds']} interleaved rounds; server: {r['server_detail']}; moto reads the whole "
             f"object for every GET ({probe['per_get_cost_of_the_object_size_ms']:.1f} ms each here), real S3 does not")
    one, raw = r["ratio"]["parallel_vs_one_get"]["median"], r["ratio"]["parallel_vs_raw"]["median"]
    ours = r["parallel"]["median_mbps"]
    return [
        Measure(key=f"s3read.parallel_vs_one_get.{mib}mib",
                title=f"S3 {mib} MiB row, parallel ranged GETs vs one GET (moto on loopback)",
                ours=ours, unit="MB/s", baseline=r["one_get"]["median_mbps"], baseline_label="one GET (read_row)",
                ratio=one, target=f">= {VS_ONE_GET:.1f}x", met=one >= VS_ONE_GET, command=cmd, sizes=sizes),
        Measure(key=f"s3read.parallel_vs_raw.{mib}mib",
                title=f"S3 {mib} MiB row, read_row (verified) vs raw client bandwidth, same GETs",
                ours=ours, unit="MB/s", baseline=r["raw_parallel"]["median_mbps"],
                baseline_label="s3fs cat_ranges alone (same parts, no copy, no hash)", ratio=raw,
                target=f">= {VS_RAW:.1f}x", met=raw >= VS_RAW, command=cmd, sizes=sizes),
    ]
