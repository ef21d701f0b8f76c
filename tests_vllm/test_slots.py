"""A MinT adapter's activation leaves its LoRA slot exactly as vLLM's own activation would."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import OFFLINE_ENV, Mint, World, plugin_env, run_bounded, write_json

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

HERE = Path(__file__).parent


def test_every_slot_byte_after_mint_and_vllm_activations_in_one_slot(world: World, mint: Mint,
                                                                     tmp_path: Path) -> None:
    a, c = str(world.adapters["a"]), str(world.adapters["c"])  # a: r8 on q,k,v,o; c: r4 on q,v,gate,down
    steps = [
        ["mint", "c", "acme/c:prod"],  # into a slot of stale bytes nothing is known of ("dirty"): all cleared
        ["local", "a", a],  # vLLM's own activation: rank 8 on q, k, v, o
        ["mint", "c", "acme/c:prod"],  # rank 4 where 8 was; k and o emptied; gate and down filled
        ["mint", "a", "acme/a:prod"],  # rank 8 where 4 was
        ["mint", "b", "acme/b:prod"],  # rank 8 where 8 was: nothing to clear
        ["local", "c", c],  # vLLM's own again, after MinT's
        ["mint", "a", "acme/a:prod"],  # from vLLM's CPU cache, into the slot c left
        ["mint", "c", "acme/c:prod"],
    ]
    spec = write_json(tmp_path / "spec.json", {"model": str(world.model), "steps": steps, "dirty": True})
    out = tmp_path / "out.json"
    env = plugin_env(tmp_path / "cache", MINT_STORE=str(mint.store), MINT_VLLM_LOAD="direct", **OFFLINE_ENV)
    rc, log = run_bounded([sys.executable, str(HERE / "slots_run.py"), str(spec), str(out)], env=env, cwd=HERE,
                          timeout=300)
    assert rc == 0, log[-8000:]
    got = json.loads(out.read_text())

    checked = got["checked"]
    assert checked["mismatched"] == []
    assert checked["activations"] == len(steps) and checked["slots"] > 0
    # MinT's activations took the path that clears only what the copy leaves, their copies made
    # together at the end of each activation (slots.py); vLLM's took its own
    counts = got["counts"]
    assert counts["mint"] > 0 and counts["vllm"] > 0 and counts["batched"] == counts["mint"]
    tokens = got["tokens"]
    assert tokens[0] == tokens[2] == tokens[5] == tokens[7]  # c through MinT (first, after a), and vLLM's own c
    assert tokens[1] == tokens[3] == tokens[6]  # a
    assert tokens[1] != tokens[2] != tokens[4]  # (not vacuous: three different outputs)
