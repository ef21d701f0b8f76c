"""The measures of tools/bench_vllm.py (a cold adapter in vLLM, a tag move) for the suite's table."""

from __future__ import annotations

from typing import Any

from .measure import Measure

# issue 35: the direct row path against vLLM's own local directory, extra latency of a first request
COLD_TARGETS = {1: 1.0, 16: 0.5, 64: 0.5}


def vllm_measures(r: dict[str, Any], cmd: str) -> list[Measure]:
    c = r["config"]
    model = f"Llama hidden {c['hidden']}, {c['layers']} layers, bf16, LoRA on 7 modules"
    key, how = {  # the plugin on the store's directory; the service's Unix socket; the service over HTTP
        "store": (".store", "rows direct, store read in vLLM's process"),
        "socket": (".socket", "rows direct, copied by the service on this machine"),
    }.get(c.get("access", "service"), ("", "rows direct, over the service's HTTP on loopback"))
    out = []
    for rank, s in (r.get("cold") or {}).get("summary", {}).items():
        target = COLD_TARGETS.get(int(rank))
        timed = "direct_cold_vs_local" in s  # (runs before the loads were timed in vLLM's worker: first - warm)
        ours, base, ratio = ((s["direct_cold_s"], s["local_cold_s"], s["direct_cold_vs_local"]) if timed else
                             (s["direct_load_s"], s["local_load_s"], s["direct_vs_local"]))
        what = ("the resolver plus vLLM's worker loading the adapter into its slot (add_adapter), timed where it "
                f"runs; a first 1-token request minus a warm one: {s['direct_load_s'] * 1e3:.1f} vs "
                f"{s['local_load_s'] * 1e3:.1f} ms ({s['direct_vs_local']:.2f}x)"
                + (f"; vLLM's own part of the direct load (merge, CPU cache, activation copy) "
                   f"{s['direct_vllm_s'] * 1e3:.1f} ms, so {s['direct_floor_vs_local']:.2f}x of the local directory "
                   f"even if reading the row cost nothing" if "direct_floor_vs_local" in s else "")
                + (f"; with one pread of the row on one CPU ({s['direct_read_floor_s'] * 1e3:.1f} ms, the least a read "
                   f"can cost here) {s['direct_read_floor_vs_local']:.2f}x: no path that reads the row gets below it"
                   if "direct_read_floor_vs_local" in s else "") if timed else
                "a first 1-token request minus a warm one of the same adapter")
        files = s["files_cold_s" if timed else "files_load_s"]
        out.append(Measure(
            key=f"vllm{key}.cold.r{rank}.vs_local", title=f"vLLM cold adapter through MinT ({how}), r{rank}",
            ours=ours * 1e3, unit="ms", baseline=base * 1e3,
            baseline_label="vLLM LoRARequest on a local PEFT directory", ratio=ratio,
            higher_is_better=False, target="" if target is None else f"<= {target:g}x",
            met=None if target is None else ratio <= target, command=cmd,
            sizes=f"{model}; {what}; medians of {s['rounds']} interleaved rounds; files path "
                  f"{files * 1e3:.1f} ms ({files / base:.2f}x); over a base step (vLLM's CPU LoRA compute "
                  f"included) {s['direct_s'] * 1e3:.0f} vs {s['local_s'] * 1e3:.0f} ms; tokens mismatched "
                  f"{s['tokens_mismatched']}"))
    m = r.get("move")
    if m:
        for q in ("p50", "p99"):
            ratio = m[f"first_{q}_s"] / m[f"warm_{q}_s"]
            out.append(Measure(
                key=f"vllm.move.first_vs_warm_{q}", title=f"first request after a tag move vs a warm one, {q}",
                ours=m[f"first_{q}_s"] * 1e3, unit="ms", baseline=m[f"warm_{q}_s"] * 1e3,
                baseline_label="warm request right before each move (adapter held)", ratio=ratio,
                higher_is_better=False,
                target="<= 1.0x", met=ratio <= 1.0, command=cmd,
                sizes=f"vllm serve, prefix caching on, {m['prompt_tokens']}-token prompt, 1 token; "
                      f"{len(m['first_s'])} moves, each first paired with the warm request before its move"
                      + (f" (first not slower in {m['pairs_first_not_slower']} of {len(m['first_s'])} pairs; "
                         f"median difference {m['pair_diff_p50_s'] * 1e3:+.1f} ms; every warm request: p50 "
                         f"{m['warm_all_p50_s'] * 1e3:.1f}, p99 {m['warm_all_p99_s'] * 1e3:.1f} ms, "
                         f"n={len(m['warm_s']) + len(m['before_s'])})" if "pair_diff_p50_s" in m else "")
                      + f"; cold first request {m['cold_p50_s'] * 1e3:.1f} ms; "
                      f"wrong content served {len(m['versions_served_wrong'])}"))
    return out
