"""How the mixed-batch bench times its variants, and the LoRA ops' own time.

**Paired rounds.** The LoRA overhead is a variant's time minus the base's: a small difference
of two large times, each of which varies by tens of percent from run to run on a shared CPU.
So every round runs base, engine (and PEFT) back to back on the same input, in an order that
rotates from round to round (no variant always runs first, after a cold cache, or last), and
the overhead is the **median over rounds of the within-round difference**, given with its
interquartile range and its min/max, beside the base's own spread. A drift of the machine's
load over the run hits both sides of a within-round difference alike. On CPU with one torch
thread the rounds are timed in the thread's CPU time (:func:`clock`): time the machine's other
processes held the core is not the variant's, and on a shared 2-core machine it was most of
the spread (the interquartile range of a 512 x 512 layer's LoRA overhead: 8 ms wall, 3 ms CPU).

Rounds per (N, shape): at least ``repeat``; then on until every variant has run for
``budget_s`` in total, or ``max_rounds`` rounds (twice that in decode, whose steps are cheap).
A large N thus gets ``repeat`` rounds and a small one many, the whole bench about as long as
a fixed count of ``repeat`` rounds would take.

**Resolved or within noise.** An overhead is *resolved* when the lower quartile of its
per-round differences is above zero and its median above the base's own interquartile spread;
otherwise it is *within noise*, bounded by ``noise_bound_s`` (the larger of the upper quartile
of its differences and the base's spread), and no ratio is drawn from its median.

**The median's 95% interval** (``overhead_ci95_s``): the distribution-free confidence interval
of the median of the paired differences, from their order statistics (the k-th smallest and
k-th largest, k the largest with binomial coverage >= 95%; 6 rounds at least, else None). It
narrows as rounds are added, where the base's spread does not; a target is decided from it
where the median is within noise (:mod:`.mixed_measures`), and PEFT/engine's lower bound is
PEFT's interval low over the engine's interval high.

**The LoRA ops alone** (``lora_ops_s``): more engine forwards (``lora_runs``, each op's best
of them) under ``torch.profiler``, with every function of ``engine_client.kernels.ops`` the engine
calls wrapped, from here, in a ``record_function`` range (the engine's code is untouched, and
unwrapped again after). The self times of the ops inside those ranges are summed, less the
base's own matmul inside ``linear_lora`` (its ``aten::addmm`` with the torch ops, its
``aten::linear`` before the grouped kernels): the LoRA
arithmetic and its gathers alone, a figure that does not carry the base's noise. It leaves
out the hooks' Python bookkeeping and what the LoRA ops cost the base through the caches;
the Python inside the kernel functions (inflated by the profiler) is ``lora_host_s``.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

RANGE_PREFIX = "mint.lora."
# the base's own work inside a kernel that fuses it with the LoRA delta: not LoRA time
BASE_OPS = {"linear_lora": frozenset({"aten::addmm_", "aten::addmm", "aten::linear"})}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def clock(device: str) -> tuple[str, Callable[[], float]]:
    """The clock the rounds are timed with: on CPU with one torch thread, this thread's CPU time (what
    the variant computed, without the time other processes held the core: on a shared machine most
    of the spread); otherwise (more threads, whose CPU times add up; CUDA) the wall clock."""
    if device == "cpu" and torch.get_num_threads() == 1:
        return "thread CPU time", time.thread_time
    return "wall clock", time.perf_counter


def _once(fn: Callable[[], object], device: str) -> float:
    now = clock(device)[1]
    _sync(device)
    t0 = now()
    fn()
    _sync(device)
    return now() - t0


def round_limits(repeat: int, max_rounds: int, *, decode: bool) -> tuple[int, int]:
    """(least, most) rounds: at least ``repeat``; at most ``max_rounds`` (twice in decode), never under ``repeat``."""
    return repeat, max(repeat, max_rounds * (2 if decode else 1))


def enough(times: dict[str, list[float]], repeat: int, max_rounds: int, budget_s: float, *, decode: bool) -> bool:
    """Whether the rounds in ``times`` suffice: the least made, and every variant past the budget or the most made."""
    least, most = round_limits(repeat, max_rounds, decode=decode)
    done = len(next(iter(times.values())))
    return done >= least and (done >= most or min(sum(t) for t in times.values()) >= budget_s)


def time_rounds(variants: dict[str, Callable[..., Any]], kw: dict[str, Any], *, decode: bool, repeat: int,
                max_rounds: int, budget_s: float, device: str) -> dict[str, list[float]]:
    """Seconds of each variant in each round, on the same input; the order rotates by one each round.
    Decode: one step on a fresh copy of one KV cache (the copy untimed)."""
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    if decode:
        cache = variants["base"](**kw, use_cache=True).past_key_values  # the same cache for every variant
        step = kw["input_ids"][:, -1:]
    r = 0
    while not enough(times, repeat, max_rounds, budget_s, decode=decode):
        for k in names[r % len(names):] + names[: r % len(names)]:
            args = {"input_ids": step, "past_key_values": copy.deepcopy(cache)} if decode else kw
            times[k].append(_once(functools.partial(variants[k], **args), device))
        r += 1
    return times


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def median_interval(xs: list[float], level: float = 0.95) -> list[float] | None:
    """The distribution-free ``level`` confidence interval of the median of ``xs``: ``[x_(k), x_(n+1-k)]``
    of the sorted values, k the largest with ``1 - 2 P(Binomial(n, 1/2) <= k - 1) >= level``;
    None where even ``[min, max]`` covers less (fewer than 6 values at 95%)."""
    n, s = len(xs), sorted(xs)
    k, below = 0, 0.0  # below: P(B <= k - 1), B ~ Binomial(n, 1/2)
    while k < n // 2 and 1 - 2 * (below + math.comb(n, k) / 2**n) >= level:
        below += math.comb(n, k) / 2**n
        k += 1
    return None if k == 0 else [s[k - 1], s[n - k]]


def _paired(times: dict[str, list[float]], variant: str) -> list[float]:
    """Each round's ``variant`` time less that round's base time."""
    return [v - b for v, b in zip(times[variant], times["base"], strict=True)]


def overhead_fields(times: dict[str, list[float]], variant: str) -> dict[str, Any]:
    """``{variant}_overhead_s`` (the median paired difference) with its spread, its 95% interval and
    whether it is resolved."""
    diffs = _paired(times, variant)
    med, (q1, q3) = statistics.median(diffs), _quartiles(diffs)
    b1, b3 = _quartiles(times["base"])
    resolved = q1 > 0 and med > b3 - b1
    return {f"{variant}_overhead_s": med, f"{variant}_overhead_iqr_s": [q1, q3],
            f"{variant}_overhead_range_s": [min(diffs), max(diffs)], f"{variant}_resolved": resolved,
            f"{variant}_noise_bound_s": max(q3, b3 - b1), f"{variant}_overhead_ci95_s": median_interval(diffs)}


def with_intervals(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its overheads' 95% intervals, computed from its stored rounds (``rounds_s``) where it
    predates them, and its ratios recomputed with them; a row without rounds as it is."""
    rounds = row.get("rounds_s")
    if not rounds or "base" not in rounds:
        return row
    out = dict(row)
    for v in ("engine", "peft"):
        if v in rounds and out.get(f"{v}_overhead_ci95_s") is None:
            out[f"{v}_overhead_ci95_s"] = median_interval(_paired(rounds, v))
    return out | ratios(out)


def timing_fields(times: dict[str, list[float]]) -> dict[str, Any]:
    """A row's timing fields: medians, the base's spread, the raw rounds, and each variant's overhead."""
    b1, b3 = _quartiles(times["base"])
    out: dict[str, Any] = {
        "rounds": len(times["base"]), "base_s": statistics.median(times["base"]),
        "engine_s": statistics.median(times["engine"]),
        "peft_s": statistics.median(times["peft"]) if "peft" in times else None,
        "base_spread_s": b3 - b1, "base_range_s": [min(times["base"]), max(times["base"])],
        "rounds_s": times, **overhead_fields(times, "engine")}
    if "peft" in times:
        out |= overhead_fields(times, "peft")
    else:
        out |= {"peft_overhead_s": None, "peft_resolved": None}
    return out


def ratios(row: dict[str, Any]) -> dict[str, Any]:
    """engine/floor and PEFT/engine; the latter only from resolved overheads, else a lower bound."""
    o_eng, o_peft = row["engine_overhead_s"], row["peft_overhead_s"]
    out: dict[str, Any] = {"engine_over_floor": o_eng / row["floor_s"], "peft_over_engine": None,
                           "peft_over_engine_at_least": None}
    if row.get("unfused_floor_s"):
        out["engine_over_unfused"] = o_eng / row["unfused_floor_s"]
    if o_peft is not None and row["peft_resolved"]:
        ci_eng, ci_peft = row.get("engine_overhead_ci95_s"), row.get("peft_overhead_ci95_s")
        if row["engine_resolved"]:
            out["peft_over_engine"] = o_peft / o_eng
        elif ci_eng is not None and ci_peft is not None:  # PEFT's least over the engine's most, both at 95%
            out["peft_over_engine_at_least"] = ci_peft[0] / ci_eng[1] if ci_eng[1] > 0 and ci_peft[0] > 0 else None
        elif row["engine_noise_bound_s"] > 0:  # the engine's overhead is below its bound
            out["peft_over_engine_at_least"] = o_peft / row["engine_noise_bound_s"]
    if "lora_ops_s" in row:
        out["lora_ops_over_floor"] = row["lora_ops_s"] / row["floor_s"]
    return out


@contextmanager
def kernel_ranges() -> Iterator[None]:
    """Every public function of ``engine_client.kernels.ops``, the experts' LoRA kernel of
    ``engine_client.kernels.moe`` (not its routing, which the base's expert matmuls use too),
    wherever an ``engine_client`` module bound it, and the grouped kernels' SHRINK-then-EXPAND
    (``GroupedKernels.add_grouped``: the experts' grouped path calls it directly), run inside a
    ``record_function`` range named for it until the block ends. The C kernels mark their calls
    as ops of their own (``mint::cpu_shrink``, ``mint::cpu_expand``, ``mint::cpu_shrink_expand``),
    so they count as LoRA ops."""
    from engine_client.kernels import moe as moe_kernels
    from engine_client.kernels import ops as kernels
    from engine_client.kernels.groups import GroupedKernels

    originals = {name: getattr(kernels, name) for name in kernels.__all__}
    originals["add_expert_lora"] = moe_kernels.add_expert_lora
    by_id = {id(f): name for name, f in originals.items()}
    wrapped = {name: _in_range(name, f) for name, f in originals.items()}
    patched: list[tuple[Any, str, Any]] = []
    for mod in [m for name, m in sys.modules.items() if name.startswith("engine_client") and m is not None]:
        for attr, value in list(vars(mod).items()):
            if callable(value) and id(value) in by_id:
                patched.append((mod, attr, value))
                setattr(mod, attr, wrapped[by_id[id(value)]])
    grouped = GroupedKernels.add_grouped
    GroupedKernels.add_grouped = _in_range("add_grouped", grouped)  # type: ignore[method-assign]
    try:
        yield
    finally:
        GroupedKernels.add_grouped = grouped  # type: ignore[method-assign]
        for mod, attr, value in patched:
            setattr(mod, attr, value)


def _in_range(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(RANGE_PREFIX + name):
            return fn(*args, **kwargs)

    return run


def lora_time(events: Any, device: str) -> tuple[list[tuple[str, float]], float, int]:
    """(the LoRA ops as (name, seconds) in the order they ran, host seconds, kernel calls) inside the
    kernel ranges of a profile's events."""
    cuda = device.startswith("cuda")
    ops: list[tuple[float, str, float]] = []
    host = 0.0
    calls = 0
    for e in events:
        chain = [e]
        while chain[-1].cpu_parent is not None:
            chain.append(chain[-1].cpu_parent)
        ranges = [i for i, c in enumerate(chain) if c.name.startswith(RANGE_PREFIX)]
        if not ranges:
            continue
        outer = ranges[-1]
        if ranges[0] == 0:  # a range itself: the Python between its ops
            host += e.self_cpu_time_total
            calls += outer == 0
            continue
        base = BASE_OPS.get(chain[outer].name[len(RANGE_PREFIX):], frozenset())
        if any(c.name in base for c in chain[:outer]):
            continue
        ops.append((e.time_range.start, e.name, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6))
    return [(name, t) for _, name, t in sorted(ops)], host / 1e6, calls


def lora_ops_fields(engine: Callable[..., Any], kw: dict[str, Any], *, decode: bool, runs: int,
                    device: str) -> dict[str, Any]:
    """``lora_ops_s`` over ``runs`` profiled engine forwards, the range of their sums, and ``lora_host_s``.

    The same forward runs the same ops in the same order, so each op's time is its best of the
    runs (a preemption that stretched one op in one run is dropped) and ``lora_ops_s`` their sum;
    were the sequences to differ, the best of the runs' sums.
    """
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    if decode:
        cache = engine(**kw, use_cache=True).past_key_values
        step = kw["input_ids"][:, -1:]
    found = []
    with kernel_ranges():
        for _ in range(runs):
            args = {"input_ids": step, "past_key_values": copy.deepcopy(cache)} if decode else kw
            with _quiet_stderr(), profile(activities=acts) as prof:
                engine(**args)
                _sync(device)
            found.append(lora_time(prof.events(), device))
    sums = [sum(t for _, t in f[0]) for f in found]
    names = [[name for name, _ in f[0]] for f in found]
    same = all(n == names[0] for n in names)
    best = sum(min(col) for col in zip(*[[t for _, t in f[0]] for f in found], strict=True)) if same else min(sums)
    return {"lora_ops_s": best, "lora_ops_range_s": [min(sums), max(sums)], "lora_ops_op_by_op": same,
            "lora_host_s": statistics.median(f[1] for f in found), "lora_kernel_calls": found[0][2],
            "lora_runs": runs}


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null: the profiler's C++ side logs two lines per session there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
