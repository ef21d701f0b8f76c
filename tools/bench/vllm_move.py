"""A tag move reaching a running ``vllm serve``: the first request after it vs a warm request.

Run by ``tools/bench_vllm.py --part move`` in an interpreter that has vLLM. Starts the OpenAI
server (prefix caching on; every request's prompt begins with its own two tokens, so none
reuses another's cached blocks and each prefills all its 16) with the plugin following the MinT
service of ``MINT_SERVER``; publishes ``moves + 1`` versions of ``bench/moving`` and tags the
first ``prod``. Then: one-token completions of ``bench/moving:prod`` while it is held (warm);
for each move, the tag moved, the server watched until the name serves the new content (the
follower loads the new content first and then switches the name to it, ``MINT_VLLM_WARM=1``,
the default: ``engine_client/vllm_plugin/preload.py``), and the first completion after that
timed. Each first is paired with the warm completion right before its move, the baseline of
the target: as many samples as there are moves, taken at the same moments (on a shared CPU a
completion's time swings by tens of percent over a run, and a p99 of a few samples is their
maximum: a baseline of more samples, or of other moments, would not compare like with like).
For scale, a cold one: the first completion of a ref never loaded. Afterwards each version's
first-after-move tokens are checked against a fresh load of the pinned version
(``bench/moving@N``): a move can never be served with the old content's cached KV.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

PROMPT = [(7 * i) % 1000 + 1 for i in range(16)]  # as the cold part's (bench_vllm.py): one token after it


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run(spec)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: str, max_rank: int, log: Path) -> None:
        self.url = f"http://127.0.0.1:{_port()}"
        self.log = open(log, "wb")  # noqa: SIM115 -- closed in stop()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", self.url.rsplit(":", 1)[1], "--skip-tokenizer-init", "--enforce-eager", "--enable-lora",
               "--max-lora-rank", str(max_rank), "--max-loras", "2", "--max-cpu-loras", "4",
               "--max-model-len", "1024", "--max-num-seqs", "4", "--dtype", "bfloat16", "--seed", "0",
               "--kv-cache-memory-bytes", str(256 << 20), "--enable-prefix-caching"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.flush()
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"vllm serve not ready after 600 s; see {log}")

    def complete(self, model: str, salt: int) -> tuple[float, list[int]]:
        """One token for the prompt begun with ``salt``: a new salt shares no cached block with
        any earlier prompt, so warm and first-after-a-move requests both prefill it whole."""
        prompt = [salt % 1000 + 1, salt // 1000 % 1000 + 1, *PROMPT[2:]]
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                           "return_token_ids": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
        return time.perf_counter() - t, list(out["choices"][0]["token_ids"])

    def models(self) -> dict[str, str]:
        """Model name -> its path (``root``): a MinT name's path names its content."""
        with urllib.request.urlopen(self.url + "/v1/models", timeout=60) as r:
            return {m["id"]: str(m.get("root") or "") for m in json.loads(r.read())["data"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from engine_client import SyncMintClient
    from mint_store import Adapter, LoraModule, load_peft_dir

    moves = int(spec["moves"])
    rank = max(spec["ranks"])
    sources = [item["local_dir"] for item in spec["adapters"][str(rank)]]
    sources = (sources * (moves // len(sources) + 2))[: moves + 2]
    with SyncMintClient(spec["server_url"]) as c:
        # distinct content per version: the same weights scaled by the version number
        content = {}
        for v, src in enumerate(sources[: moves + 1], start=1):
            adapter = load_peft_dir(src, base="bench-llama")
            adapter = Adapter(adapter.base, tuple(LoraModule(m.name, m.a, m.b, m.scaling * v) for m in adapter.modules))
            content[v] = c.publish("bench", "moving", adapter).content_id
        c.tag("bench/moving@1", "prod")
        c.publish("bench", "cold", load_peft_dir(sources[-1], base="bench-llama"))
    server = Server(spec["model"], rank, Path(sys.argv[2]).with_suffix(".vllm.log"))
    try:
        name = "bench/moving:prod"
        salts = iter(range(1, 10**6))
        server.complete(name, next(salts))  # resolved, tracked by the follower, loaded
        warm = [server.complete(name, next(salts))[0] for _ in range(20)]
        before, first, switch, got = [], [], [], {}
        with SyncMintClient(spec["server_url"]) as c:
            for v in range(2, moves + 2):
                # the pair: a warm request right before the move, the first one right after it
                before.append(server.complete(name, next(salts))[0])
                c.tag(f"bench/moving@{v}", "prod")
                t = time.monotonic()
                # switched: the name serves the new content (its path names it), or was dropped (MINT_VLLM_WARM=off)
                while server.models().get(name, content[v]).rsplit("/", 1)[-1] != content[v]:
                    if time.monotonic() - t > 120:
                        raise RuntimeError(f"the server did not switch {name} in 120 s")
                    time.sleep(0.01)
                switch.append(time.monotonic() - t)
                salt = next(salts)
                s, tokens = server.complete(name, salt)
                got[v] = (salt, tokens)
                first.append(s)
                warm += [server.complete(name, next(salts))[0] for _ in range(3)]
        cold = [server.complete("bench/cold", next(salts))[0]]
        # the first answer after each move is the moved-to version's own (a pinned ref, loaded afresh)
        wrong = [v for v, (salt, tokens) in got.items() if server.complete(f"bench/moving@{v}", salt)[1] != tokens]
    finally:
        server.stop()
    diff = np.array(first) - np.array(before)  # [moves] first after a move minus the warm one before it
    return {"warm_s": warm, "before_s": before, "first_s": first, "switch_s": switch, "cold_s": cold,
            # the baseline is the warm request right before each move: as many samples as the firsts, taken
            # at the same moments (a p99 of a few samples is their maximum; so is the baseline's)
            "warm_p50_s": float(np.percentile(before, 50)), "warm_p99_s": float(np.percentile(before, 99)),
            "warm_all_p50_s": float(np.percentile(warm + before, 50)),
            "warm_all_p99_s": float(np.percentile(warm + before, 99)),
            "pair_diff_p50_s": float(np.percentile(diff, 50)), "pairs_first_not_slower": int((diff <= 0).sum()),
            "first_p50_s": float(np.percentile(first, 50)), "first_p99_s": float(np.percentile(first, 99)),
            "switch_p50_s": float(np.percentile(switch, 50)), "cold_p50_s": float(np.percentile(cold, 50)),
            "versions_served_wrong": wrong, "prompt_tokens": len(PROMPT)}


if __name__ == "__main__":
    main()
