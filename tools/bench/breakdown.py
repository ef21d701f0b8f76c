"""Where the time goes, from parts each tool measured in the same run (not from a profiler):
a cold switch split into its byte work (read, hash, copy) and the rest; a verified read
against the same read without the hash; a training wave's CPU time against its wall time;
a mixed batch's LoRA overhead that misses 3x its floor against the activations' traffic.
Every sentence is built from the results JSON; nothing here is typed in by hand."""

from __future__ import annotations

from typing import Any

from .mixed_measures import FLOOR_TARGET


def _us(x: float) -> str:
    return f"{x:,.0f} us" if x >= 100 else f"{x:.1f} us"


def swap_lines(results: dict[str, Any]) -> list[str]:
    out = []
    for c in results.get("cases", []):
        b = {k: v["p50"] for k, v in c.get("bytes_us", {}).items()}
        if not {"pread", "hash", "memcpy"} <= b.keys():
            continue
        cold, warm = c["switch"]["cold"]["p50"], c["switch"]["warm"]["p50"]
        three = b["pread"] + b["hash"] + b["memcpy"]  # read, then hash, then copy: three passes
        if cold <= three:
            how = (f"{cold / three:.2f} of the {_us(three)} those three passes take one after another (the row is "
                   f"read once, hashed as it lands, and on the CPU read straight into the slot); one read alone "
                   f"is {cold / b['pread']:.2f}x of the switch")
        else:
            how = f"{_us(cold - three)} more than those three passes one after another"
        warm_copy = b.get("memcpy_warm", b["memcpy"])
        out.append(
            f"- **{c['case']}** (row {c['adapter_bytes']:,} B): a cold switch takes p50 {_us(cold)}. Timed alone on "
            f"the same rows, a read from the page cache takes {_us(b['pread'])}, the xxh3 check {_us(b['hash'])} and "
            f"a copy into the slot {_us(b['memcpy'])}: the switch is {how}. A warm switch (row in the host cache, "
            f"p50 {_us(warm)}) is the copy ({_us(warm_copy)}) plus {_us(max(warm - warm_copy, 0))}.")
        vllm = c.get("vllm_add_lora_s")
        if vllm:
            v_us = vllm["p50"] * 1e6
            bound = v_us / b["pread"]
            out.append(
                f"  vLLM's `add_lora` of the same adapter takes {_us(v_us)} (p50); one read of the row alone (the "
                f"least byte work a switch can do) bounds our ratio against it at {bound:.1f}x on this machine "
                f"(target 20x{', which these bytes do not allow' if bound < 20 else ''}).")
    probe = results.get("probe")
    if probe and probe.get("bytes_us"):
        b = {k: v["p50"] for k, v in probe["bytes_us"].items()}
        cold = probe["switch"]["cold"]["p50"]
        out.append(
            f"- **fixed cost** (a {probe['row_bytes']:,} B row, where bytes cost almost nothing: read "
            f"{_us(b['pread'])}, hash {_us(b['hash'])}, copy {_us(b['memcpy'])}): a cold switch takes "
            f"{_us(cold)} p50, so {_us(probe['fixed_us']['cold_above_byte_work'])} is the per-switch cost of "
            "resolve, slot choice, bookkeeping and the engine's lock.")
    return out


def store_lines(name: str, results: dict[str, Any]) -> list[str]:
    out = []
    for rank, v in sorted(results.get("reads_by_rank", {}).items(), key=lambda kv: int(kv[0])):
        if "unverified_ratio" not in v:
            continue
        out.append(
            f"- **{name}, rank {rank}** (row {v['row_nbytes']:,} B): a verified read runs at {v['ratio']:.2f}x of "
            f"raw `os.pread`; the same read without the xxh3 check runs at {v['unverified_ratio']:.2f}x. The "
            f"difference is the hash every read pays (every read is checked against its content id)."
            + (f" Each of {v['first_rows']:,} rows read once through a storage opened afresh (each shard opened and "
               f"mapped again: a row pays its share of that and its first-touch page faults; the page cache is warm): "
               f"{v['first_ratio']:.2f}x of raw `os.pread` of the same rows on descriptors already open."
               if "first_ratio" in v else ""))
    return out


def train_lines(results: dict[str, Any]) -> list[str]:
    out = []
    for r in results.get("rows", []):
        if r["policies"] < 2:
            continue
        why = (" With one thread per run, the gain is CPU work removed, not idle hardware put to use (on a GPU, "
               "the paper's setting, small per-policy batches leave the device idle)." if r["threads"] == 1 else "")
        threads = f"{r['threads']} thread" + ("" if r["threads"] == 1 else "s")
        out.append(
            f"- **{r['base']}, {r['policies']} policies**: concurrent training is {r['concurrent_speedup']:.2f}x "
            f"faster in wall time and takes {r['concurrent_cpu_speedup']:.2f}x less CPU time than one by one, "
            f"with {threads} per run.{why} Peak RSS is {r['concurrent_peak_mib']:.0f} MiB concurrent against "
            f"{r['one_by_one_peak_mib']:.0f} MiB one by one."
            + (" Micro-batched (forward and backward in chunks of one policy's rows, gradients accumulated) it "
               f"is {r['concurrent_mb_speedup']:.2f}x at a peak of {r['concurrent_mb_peak_mib']:.0f} MiB."
               if "concurrent_mb_speedup" in r else ""))
    return out


def mixed_lines(results: dict[str, Any], target: float = FLOOR_TARGET) -> list[str]:
    """Each mixed-batch row at N >= 64 whose resolved overhead is above ``target`` floors, against
    the unfused bound (mixed_bench.roofline): the activations' traffic of a LoRA in passes of
    its own, at the copy bandwidth, an estimate (activations still in cache move faster)."""
    out = []
    bw = results["machine"]["bandwidth_Bps"]
    for r in results.get("rows", []):
        if (r["n"] < 64 or not r.get("engine_resolved") or r["engine_over_floor"] <= target
                or r.get("unfused_floor_s") is None or r.get("lora_ops_s") is None):
            continue
        floor, unfused, ops = r["floor_s"] * 1e3, r["unfused_floor_s"] * 1e3, r["lora_ops_s"] * 1e3
        eng, act, moe = r["engine_overhead_s"] * 1e3, r["activation_bytes"], r.get("family") == "moe"
        line = (f"- **{r.get('family', 'dense')} {r['shape']}, N = {r['n']:,}** (LoRA overhead {eng:.1f} ms, "
                f"{r['engine_over_floor']:.1f}x the floor of {floor:.2f} ms; the LoRA ops alone {ops:.1f} ms): a LoRA "
                "in passes of its own beside the base layer reads each module's input and adds into its output, "
                f"{act / 1e6:,.0f} MB of activations (in + 2 x out values per module and token) besides the adapters' "
                f"{r['adapter_bytes'] / 1e6:,.0f} MB: {act / bw * 1e3:.1f} ms at the measured {bw / 1e9:.1f} GB/s. "
                f"With them the bound is {unfused:.1f} ms ({unfused / floor:.1f}x the floor); the overhead is "
                f"{eng / unfused:.2f}x of it.")
        if unfused > target * floor:
            line += (f" At the copy bandwidth no LoRA in passes of its own could meet {target:g}x the floor: that "
                     "takes one fused into the base GEMM, reading the activations while they are in cache (an "
                     "estimate, not a floor: activations still in cache move faster).")
        else:
            line += (f" The activations' traffic does not explain the gap: the LoRA ops take {ops:.1f} ms of the "
                     f"overhead, and {max(eng - ops, 0):.1f} ms is outside them.")
        if eng < unfused:
            line += (" The overhead is below the bound: " + (
                "the engine's expert matmuls took less time than the base model's own, offsetting part of the LoRA's "
                "cost." if moe else "the activations moved faster than the copy bandwidth, or the rest of the "
                "engine's forward took less time than the base model's own."))
        out.append(line)
    return out


def explain(doc: dict[str, Any]) -> list[str]:
    """Markdown bullet lines, one block per benchmark that has measured parts."""
    runs = doc["runs"]
    lines: list[str] = []
    if "swap" in runs:
        lines += swap_lines(runs["swap"]["results"])
    for name in ("store", "store-1m"):
        if name in runs:
            lines += store_lines(name, runs[name]["results"])
    if "train" in runs:
        lines += train_lines(runs["train"]["results"])
    if "mixed" in runs:
        lines += mixed_lines(runs["mixed"]["results"])
    return lines
