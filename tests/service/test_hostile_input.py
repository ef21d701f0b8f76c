"""Hostile input over HTTP (issue 12, items 3, 4 and 9): a JSON 4xx at once, never a 500 or a hang.

Catastrophic regular expressions run against a server in a subprocess: on the old code
Python's ``re`` held the GIL for ever, so a server in the test's own process would have
frozen the test too. Every request here carries a generous client timeout: a liveness
check (the fixed server answers at once), not a performance threshold.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mint_store.service import RunningServer
from mint_store.service.auth import TokenTable
from mint_store.service.state import STATE
from tests.support.service import expect_error, peft_form, publish, snapshot, still_serving, upload_dir

W, C = "adapter_model.safetensors", "adapter_config.json"
LIVENESS = aiohttp.ClientTimeout(total=float(os.environ.get("MINT_TEST_LIVENESS_S", 120)))
# exponential for a backtracking engine on any module path (3 ways per character), linear for RE2
CATASTROPHIC = r"([\w.]|[\w.]|[\w.])*X"


def _config(files: dict[str, bytes], **changes: Any) -> dict[str, bytes]:
    return {C: json.dumps(json.loads(files[C]) | changes).encode(), W: files[W]}


def _raw_config(files: dict[str, bytes], raw: bytes) -> dict[str, bytes]:
    return {C: raw, W: files[W]}


def _header(files: dict[str, bytes], edit: Any) -> dict[str, bytes]:
    """Rewrite the safetensors JSON header as text (so it can hold what json.dumps cannot)."""
    raw = files[W]
    n = struct.unpack("<Q", raw[:8])[0]
    text = edit(raw[8 : 8 + n].decode(), json.loads(raw[8 : 8 + n]))
    blob = text.encode()
    return {C: files[C], W: struct.pack("<Q", len(blob)) + blob + raw[8 + n :]}


def _offset_digits(text: str, header: dict[str, Any]) -> str:
    name = sorted(k for k in header if k != "__metadata__")[0]
    begin, end = header[name]["data_offsets"]
    return text.replace(f'"data_offsets":[{begin},{end}]', f'"data_offsets":[{begin},{"9" * 5000}]', 1)


def _zero_and_huge_shape(text: str, header: dict[str, Any]) -> str:
    header = dict(header)
    header["zero.lora_A.weight"] = {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}
    return json.dumps(header)


# ---------------------------------------------------------------- a server in its own process


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[str]:
    """``python -m mint_store.service`` on a free loopback port; its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mint_store.service", "--store", str(tmp_path / "store"), "--port", "0",
         "--workers", "2"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:  # ends when the process exits
            m = re.search(r"serving .* on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "the server did not start"
        yield url
    finally:
        proc.kill()  # the process this fixture started, by its handle
        proc.wait(timeout=60)


async def _put(http: aiohttp.ClientSession, url: str, files: dict[str, bytes]) -> tuple[int, dict[str, Any]]:
    async with http.put(url, data=peft_form(files), timeout=LIVENESS) as r:
        return r.status, await r.json(content_type=None)


async def test_catastrophic_patterns_neither_freeze_the_service_nor_fail(server_process, peft_files) -> None:
    targets = json.loads(peft_files[C])["target_modules"]
    names = "|".join(re.escape(t) for t in targets)
    async with aiohttp.ClientSession() as http:
        url = f"{server_process}/v1/adapters/acme"
        # matched by RE2 in linear time: the second alternative selects what the list did
        pattern = f"{CATASTROPHIC}|.*\\.({names})"
        status, body = await _put(http, f"{url}/a", _config(peft_files, target_modules=pattern))
        assert status == 201, body
        status, body = await _put(http, f"{url}/b", _config(peft_files, rank_pattern={CATASTROPHIC: 8},
                                                            alpha_pattern={CATASTROPHIC: 3},
                                                            exclude_modules=CATASTROPHIC))
        assert status == 201, body
        status, body = await _put(http, f"{url}/c", _config(peft_files, layers_to_transform=[0, 1],
                                                            layers_pattern=[CATASTROPHIC, "layers"]))
        assert status == 201, body
        # syntax only a backtracking engine can run: refused, naming the key
        status, body = await _put(http, f"{url}/d", _config(peft_files, rank_pattern={r"(q)_pro\1": 8}))
        assert status == 422 and body["error"] == "invalid_adapter", body
        assert "rank_pattern key" in body["message"] and "linear time" in body["message"], body
        async with http.get(f"{server_process}/healthz", timeout=LIVENESS) as r:
            assert r.status == 200


# ---------------------------------------------------------------- the in-process server


async def _refused(http: aiohttp.ClientSession, server: RunningServer, files: dict[str, bytes], code: str,
                   status: int = 422) -> dict[str, Any]:
    before = snapshot(server)
    async with http.put(f"{server.url}/v1/adapters/acme/chat", data=peft_form(files), timeout=LIVENESS) as r:
        body = await expect_error(r, status, code)
    assert snapshot(server) == before and upload_dir(server) == []
    await still_serving(http, server)
    return body


async def test_alpha_infinite_in_float32_is_422_at_once(server, http, peft_files) -> None:
    # the old code raised StopIteration inside the executor: the request hung for 300 s
    for changes in ({"lora_alpha": 1e39}, {"alpha_pattern": {"q_proj": 1e39}}):
        body = await _refused(http, server, _config(peft_files, **changes), "invalid_adapter")
        assert "float32" in body["message"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda f: _raw_config(f, f[C][:-1] + b', "lora_dropout": ' + b"7" * 5000 + b"}"), "5000 digits"),
        (lambda f: _raw_config(f, f[C][:-1] + b', "lora_dropout": NaN}'), "NaN"),
        (lambda f: _config(f, r=10**30), "positive integer rank"),
        (lambda f: _header(f, _offset_digits), "5000 digits"),
        (lambda f: _header(f, _zero_and_huge_shape), "too large"),
        (lambda f: _header(f, lambda t, h: json.dumps({("m." + "a" * 100_000 + ".lora_A.weight"
                                                         if k == sorted(h)[0] else k): v for k, v in h.items()})),
         "over the limit of 8192"),
    ],
    ids=["config int over 4300 digits", "config NaN", "config rank 1e30", "header int over 4300 digits",
         "shape [0, 2**70]", "tensor name of 100k chars"],
)
async def test_hostile_numbers_and_names_are_422(server, http, peft_files, make, message) -> None:
    body = await _refused(http, server, make(peft_files), "invalid_adapter")
    assert message in body["message"], body


async def test_range_header_with_a_huge_number(server, http, peft_files) -> None:
    await publish(http, server, peft_files)
    url = f"{server.url}/v1/adapters/acme/chat/versions/1/content"
    async with http.get(url) as r:
        full = await r.read()
    huge = "9" * 5000
    async with http.get(url, headers={"Range": f"bytes={huge}-"}, timeout=LIVENESS) as r:
        await expect_error(r, 416, "range_not_satisfiable")
    async with http.get(url, headers={"Range": f"bytes=3-{huge}"}, timeout=LIVENESS) as r:
        assert r.status == 206 and await r.read() == full[3:]
    async with http.get(url, headers={"Range": f"bytes=-{huge}"}, timeout=LIVENESS) as r:
        assert r.status == 206 and await r.read() == full


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/resolve", _nested(100_000)),
        ("POST", "/v1/resolve", b'{"refs": ["acme/chat"], "x": ' + _nested(50) + b"}"),
        ("POST", "/v1/resolve", b'{"refs": ["acme/chat"], "x": NaN}'),
        ("PUT", "/v1/adapters/acme/chat/tags/prod", b'{"version": ' + _nested(100_000) + b"}"),
        ("PUT", "/v1/adapters/acme/chat/tags/prod", b'{"version": ' + _nested(500) + b"}"),
        ("PUT", "/v1/bases/tiny", b'{"m": ' + _nested(100_000) + b"}"),
    ],
    ids=["resolve deep", "resolve 50 levels", "resolve NaN", "tag deep", "tag 500 levels",
         "bases deep"],
)
async def test_hostile_json_bodies_are_400(server, http, peft_files, method, path, body) -> None:
    await publish(http, server, peft_files)
    async with http.request(method, server.url + path, data=body, headers={"Content-Type": "application/json"},
                            timeout=LIVENESS) as r:
        got = await expect_error(r, 400, "bad_request")
    assert "JSON" in got["message"]
    await still_serving(http, server)


async def test_base_shapes_with_huge_integers_are_refused(server, http) -> None:
    async with http.put(f"{server.url}/v1/bases/tiny", json={"m.q": [8, 10**30]}, timeout=LIVENESS) as r:
        await expect_error(r, 422, "invalid_adapter")
    async with http.get(f"{server.url}/v1/bases/tiny", timeout=LIVENESS) as r:
        assert r.status == 404


async def test_stop_iteration_in_executor_work_is_an_error_not_a_hang(server) -> None:
    # asyncio cannot store StopIteration in a Future: the old run() never completed
    state = server.app[STATE]
    with pytest.raises(RuntimeError, match="StopIteration"):
        await asyncio.wait_for(state.run(next, iter(())), LIVENESS.total)



def test_token_file_too_deep_is_a_clear_error(tmp_path: Path) -> None:
    # the old loader let RecursionError out of startup (a traceback, not "mint: error: ...")
    path = tmp_path / "tokens.json"
    path.write_bytes(b'{"tokens": ' + _nested(100_000) + b"}")
    with pytest.raises(ValueError, match="not valid JSON"):
        TokenTable.load(str(path))


async def test_a_publish_holds_decode_memory_for_its_header_too(make_server, local_target, http,
                                                                peft_files: dict[str, bytes]) -> None:
    """Decoding a safetensors header costs ~20x its bytes (each small entry becomes a dict, a
    checked entry and a tensor): a file that is nearly all header was charged only its size,
    so uploads the budget admitted together could hold many times upload_memory."""
    from mint_store.service.routes.uploads import HEADER_EXPANSION
    from tests.support.service import store_of

    server = await make_server(local_target)
    budget = server.app[STATE].decode_budget
    weights = peft_files["adapter_model.safetensors"]
    header = int.from_bytes(weights[:8], "little")
    with store_of(server).held_commits():  # a publish holds its decode budget until its commit answers
        task = asyncio.create_task(publish(http, server, peft_files))
        for _ in range(3000):
            if budget.used:
                break
            await asyncio.sleep(0.01)
        assert budget.used == len(weights) + HEADER_EXPANSION * header
    assert (await task)["version"] == 1
    assert budget.used == 0
