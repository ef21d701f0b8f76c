"""vLLM without the MinT plugin loads adapters by Hub repo id from MinT's /hf (HF_ENDPOINT)."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest
from support import MAX_TOKENS, OFFLINE_ENV, PROMPTS, Mint, World, run_bounded, write_json

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

HERE = Path(__file__).parent
RESOLVE = "/hf/{tenant}/{name}/resolve/{revision}/{filename}"


def _resolve_gets(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics") as r:
        lines = r.read().decode().splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines
               if ln.startswith("mint_http_requests_total{") and f'route="{RESOLVE}"' in ln and 'method="GET"' in ln)


def test_lora_request_with_a_hub_repo_id_runs_the_mint_adapter(world: World, mint: Mint, tmp_path: Path) -> None:
    repos = {"a": "acme/a", "c": "acme/c"}
    spec = write_json(tmp_path / "spec.json", {
        "model": str(world.model), "direct": {k: str(world.adapters[k]) for k in repos}, "repos": repos,
        "engine": {"distributed_executor_backend": "uni"},  # vLLM's own loader: one process
    })
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "VLLM_", "HF_", "TRANSFORMERS_"))}
    env.update({
        "HF_ENDPOINT": mint.server.url + "/hf", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",  # not offline: TRANSFORMERS_OFFLINE disables the Hub
        "VLLM_PLUGINS": "",  # an allowlist naming nothing: the MinT resolver plugin is not loaded
        **OFFLINE_ENV,
    })
    gets = _resolve_gets(mint.server.url)
    rc, log = run_bounded([sys.executable, str(HERE / "hub_run.py"), str(spec), str(out)], env=env, cwd=HERE,
                          timeout=420)
    (tmp_path / "vllm.log").write_text(log)
    assert rc == 0, log[-8000:]
    got = json.loads(out.read_text())
    assert got["resolvers"] == []  # no plugin: vLLM's own loader fetched the repos
    for tokens in [got["base"], *got["direct"].values()]:
        assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    assert got["direct"]["a"] != got["base"] and got["direct"]["c"] != got["base"] and \
        got["direct"]["a"] != got["direct"]["c"]  # not vacuous
    for label in repos:
        assert got["hub"][label] == got["direct"][label], label
    # the files came from MinT, into the Hub cache of that process
    assert _resolve_gets(mint.server.url) > gets
    for repo in repos.values():
        snapshots = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots"
        assert [p.name for p in snapshots.iterdir()] and all(
            (s / "adapter_model.safetensors").is_file() for s in snapshots.iterdir())
