"""The measures of ``bench_batch.py --part peer`` (tools/bench/mixed_bench.py) for the suite's table.

An overhead is the median of paired rounds (tools/bench/mixed_rounds.py). A *resolved* one gets
its ratios to the floor and to PEFT and a verdict on them. One *within noise* shows its bound
("within noise (< X ms)", that bound as the figure) and no ratio; it gets a verdict only where
its median's 95% interval (or, in rows without one, the bound) decides it: an interval wholly at
or under 3x the floor meets that target, one wholly above misses it; PEFT/engine's lower bound
is PEFT's interval low over the engine's interval high (without intervals, PEFT's overhead over
the bound). A row re-measured alone with more rounds (``--peer-update``) names that run in its
measures' ``rerun``. Rows of results files written before the paired rounds (no ``engine_resolved``)
count a positive overhead as resolved, as then.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .measure import Measure
from .mixed_rounds import with_intervals

FLOOR_TARGET = 3.0  # the engine's overhead at N >= 64, in floors


def mixed_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    """Per shape and N: the engine's overhead against PEFT's and the floor, and the LoRA ops' own time."""
    c = r["config"]
    sizes = (f"Llama hidden {c['hidden']}, {c['layers']} layers, rank {c['rank']}, {c['tokens']} tokens per "
             f"sequence, {r['torch_threads']} torch threads, timed in {r.get('clock', 'wall clock')}")
    moe_sizes = sizes.replace("Llama", f"Qwen3-MoE ({c.get('experts')} experts, LoRA on them too)")
    out = []
    for row in r["rows"]:  # (intervals from the stored rounds where a results file predates them)
        where = moe_sizes if row.get("family") == "moe" else sizes
        rerun = f"`{row['run']['command']}` ({row['run']['time']})" if row.get("run") else ""  # --peer-update
        out += [replace(m, rerun=rerun) for m in _row_measures(with_intervals(row), where, cmd)]
    return out


def _resolved(row: dict[str, Any], variant: str) -> bool:
    return bool(row.get(f"{variant}_resolved", row[f"{variant}_overhead_s"] > 0))


def _row_measures(row: dict[str, Any], where: str, cmd: str) -> list[Measure]:
    n, shape = row["n"], row["shape"]
    moe = row.get("family") == "moe"
    key = f"mixed.{'moe.' if moe else ''}{shape}.n{n}"
    what = f"{'MoE ' if moe else ''}LoRA overhead, {shape}, {n:,} sequences each with its own adapter"
    resolved, bound = _resolved(row, "engine"), row.get("engine_noise_bound_s")
    eng = row["engine_overhead_s"] * 1e3 if resolved or bound is None else bound * 1e3
    noise, ci = "", row.get("engine_overhead_ci95_s")
    if not resolved:
        noise = (": below the base's run-to-run noise, not resolved, no verdict" if bound is None else
                 f": within noise (< {eng:.3g} ms)")
        if ci is not None:
            noise += f", median's 95% interval [{ci[0] * 1e3:.3g}, {ci[1] * 1e3:.3g}] ms"
    floor = row["floor_s"] * 1e3
    out = []
    if row["peft_overhead_s"] is not None:
        out.append(_vs_peft(row, key, what, noise, eng, n == 256 and shape == "prefill", where, cmd))
    big = n >= 64
    met = None
    if big and resolved:
        met = 0 < row["engine_over_floor"] <= FLOOR_TARGET
    elif big and ci is not None:  # the interval decides where it lies wholly on one side of the target
        target_s = FLOOR_TARGET * row["floor_s"]
        if ci[1] <= target_s:
            met = True
        elif ci[0] > target_s:
            met = False
    elif big and bound is not None and eng <= FLOOR_TARGET * floor:  # its upper bound already meets it
        met = True
    ops = row.get("lora_ops_s")
    if big and ops is not None and ops * 1e3 > eng and ops > FLOOR_TARGET * row["floor_s"]:
        # the LoRA ops alone cost more than the overhead shown (its bound, where unresolved): the
        # engine's batch runs a cheaper base path than the base model (an MoE's own expert kernels),
        # and the difference hides LoRA cost. Judged on the ops, which miss the target
        met = False
        why = "the engine's expert path is faster than the base model's" if moe else "the base path differs"
        noise += (f"; the LoRA ops alone ({ops * 1e3:.3g} ms, {ops / row['floor_s']:.2f}x the floor) cost more than "
                  f"this overhead ({why}): judged on the ops")
    out.append(Measure(
        key=f"{key}.vs_floor", title=f"{what}, vs the roofline floor ({row['bound_by']}){noise}",
        ours=eng, unit="ms", baseline=floor, baseline_label="adapter bytes / bandwidth, FLOPs / GEMM rate",
        ratio=row["engine_over_floor"] if resolved else None, higher_is_better=False,
        target=f"<= {FLOOR_TARGET:g}x floor" if big else "", met=met, command=cmd, sizes=where))
    if row.get("lora_ops_s") is not None:
        out.append(Measure(
            key=f"{key}.lora_ops_vs_floor",
            title=f"{'MoE ' if moe else ''}LoRA ops alone (profiled kernels; not their cache effects on the base), "
                  f"{shape}, {n:,} sequences, vs the roofline floor",
            ours=row["lora_ops_s"] * 1e3, unit="ms", baseline=floor, baseline_label="the same floor",
            ratio=row["lora_ops_over_floor"], higher_is_better=False, command=cmd, sizes=where))
    return out


def _vs_peft(row: dict[str, Any], key: str, what: str, noise: str, eng: float, five: bool, where: str,
             cmd: str) -> Measure:
    """Engine against PEFT: a ratio of resolved overheads, or a lower bound of it, or no verdict."""
    need = 5.0 if five else 1.0
    ratio, met, title = None, None, f"{what}, vs PEFT{noise}"
    if not _resolved(row, "peft"):
        title += "; PEFT's within noise too, no verdict"
    elif _resolved(row, "engine"):
        ratio = row["peft_over_engine"]
        met = ratio is not None and ratio >= need
    elif row.get("peft_over_engine_at_least") is not None:
        least = row["peft_over_engine_at_least"]
        title += f"; PEFT/engine >= {least:.2f}x"
        met = True if least >= need else None
    return Measure(
        key=f"{key}.vs_peft", title=title, ours=eng, unit="ms", baseline=row["peft_overhead_s"] * 1e3,
        baseline_label="PEFT mixed batch (adapter_names=)", ratio=ratio, higher_is_better=False,
        target=">= 5x" if five else "> 1x", met=met, command=cmd, sizes=where)
