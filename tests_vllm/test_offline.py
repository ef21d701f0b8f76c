"""vLLM's offline LLM API: adapters resolved by the plugin run exactly like their original PEFT dirs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import MAX_TOKENS, OFFLINE_ENV, PROMPTS, Mint, World, plugin_env, run_bounded, write_json

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

HERE = Path(__file__).parent


@pytest.mark.parametrize("load", ["direct", "files", "socket"])
def test_plugin_resolved_adapters_match_their_original_directories(world: World, mint: Mint, tmp_path: Path,
                                                                   load: str) -> None:
    refs = ["acme/a", "acme/b:prod", "acme/c@1", "acme/moving:prod"]
    # the direct path's rows are read in vLLM's worker process, so that process stays its own
    spec = write_json(tmp_path / "spec.json", {
        "model": str(world.model), "direct": {k: str(v) for k, v in world.adapters.items()}, "refs": refs,
        "engine": {"distributed_executor_backend": "mp" if load == "direct" else "uni"},
    })
    out = tmp_path / "out.json"
    # the plugin reads the service's store directly (read-only, beside the writing service); or,
    # "socket", rows the service copies into vLLM's worker through its Unix socket on this machine,
    # which the plugin finds by itself (MINT_SERVER alone: GET /v1/local-socket, then its hello)
    where = ({"MINT_SERVER": mint.server.url, "MINT_VLLM_LOAD": "direct"}
             if load == "socket" else {"MINT_STORE": str(mint.store), "MINT_VLLM_LOAD": load})
    copies = _copies(mint)
    env = plugin_env(tmp_path / "cache", **where, **OFFLINE_ENV)
    rc, log = run_bounded([sys.executable, str(HERE / "offline_run.py"), str(spec), str(out)], env=env, cwd=HERE,
                          timeout=300)
    assert rc == 0, log[-8000:]
    got = json.loads(out.read_text())
    print("offline vLLM seconds:", got["seconds"])

    direct, resolved = got["direct"], got["resolved"]
    for tokens in [got["base"], *direct.values()]:
        assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    # not vacuous: every adapter changes the output, and each differently
    outputs = [got["base"], *direct.values()]
    assert len({json.dumps(t) for t in outputs}) == len(outputs)

    assert resolved["acme/a"]["tokens"] == direct["a"]
    assert resolved["acme/b:prod"]["tokens"] == direct["b"]
    assert resolved["acme/c@1"]["tokens"] == direct["c"]
    assert resolved["acme/moving:prod"]["tokens"] == direct["a"]  # moving:prod -> @1 = a's content
    # identical content: one directory, one id
    assert resolved["acme/moving:prod"]["path"] == resolved["acme/a"]["path"]
    assert resolved["acme/moving:prod"]["id"] == resolved["acme/a"]["id"]
    expected = {"acme/a": "acme/a", "acme/b:prod": "acme/b", "acme/c@1": "acme/c", "acme/moving:prod": "acme/a"}
    kind = "entries" if load == "files" else "rows"  # rows: read by vLLM's worker from the store, no files
    for ref, r in resolved.items():
        assert r["name"] == ref
        assert Path(r["path"]) == tmp_path / "cache" / kind / mint.content[expected[ref]]
    assert (tmp_path / "cache" / "entries").exists() == (load == "files")
    assert not (tmp_path / "cache" / "rows").exists()  # a row path is never a file
    # one batch mixing the resolved adapters
    assert got["mixed"] == [resolved[r]["tokens"][0] for r in refs]
    # through the socket: each content's row copied once into the worker's memory (and no GET),
    # and once into the row cache's file, for those the worker's cache thread got to before it exited
    contents = set(mint.content[expected[r]] for r in refs)
    cached = sorted((tmp_path / "cache" / "row-cache").glob("*.row")) if load == "socket" else []
    assert {p.stem for p in cached} <= contents
    assert _copies(mint) - copies == (len(contents) + len(cached) if load == "socket" else 0)


def _copies(mint: Mint) -> int:
    from mint_store.service.local_copy import LOCAL_COPY

    return mint.server.server.app[LOCAL_COPY].copies
