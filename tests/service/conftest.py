"""Fixtures of the service tests: a real server on a loopback port, tokens, PEFT files."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mint_store.service import RunningServer, ServiceConfig, start_server
from tests.support.service import TOKENS, ServerFactory, read_peft
from tests.support.targets import StoreTarget


@pytest.fixture(scope="session")
def peft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real PEFT LoRA adapter (tiny random Llama, rank 4) saved by save_pretrained."""
    from tests.support.hf_models import make_peft_dir

    return make_peft_dir(tmp_path_factory.mktemp("peft") / "a", seed=0, r=4)


@pytest.fixture(scope="session")
def peft_dir2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another one: other modules and rank, so another layout."""
    from tests.support.hf_models import make_peft_dir

    return make_peft_dir(tmp_path_factory.mktemp("peft") / "b", seed=0, r=2, target_modules=["q_proj", "v_proj"])


@pytest.fixture
def peft_files(peft_dir: Path) -> dict[str, bytes]:
    return read_peft(peft_dir)


@pytest.fixture
def tokens_file(tmp_path: Path) -> str:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps({"tokens": [
        {"token": TOKENS["acme"], "tenants": ["acme"], "role": "write"},
        {"token": TOKENS["beta"], "tenants": ["beta"], "role": "write"},
        {"token": TOKENS["acme-read"], "tenants": ["acme"], "role": "read"},
        {"token": TOKENS["admin"], "tenants": [], "role": "admin"},
    ]}))
    return str(path)


@pytest.fixture
async def make_server(tmp_path: Path) -> AsyncIterator[ServerFactory]:
    """Start servers on 127.0.0.1 (any free port) over a store target; stopped at teardown."""
    started: list[RunningServer] = []

    async def make(target: StoreTarget, **options: Any) -> RunningServer:
        uploads = tmp_path / f"uploads-{len(started)}"
        uploads.mkdir()
        config = ServiceConfig(
            store=target.url, index_dir=target.index_dir, storage_options=target.storage_options,
            host="127.0.0.1", port=0, upload_dir=str(uploads), workers=4, **options,
        )
        server = await start_server(config)
        started.append(server)
        return server

    yield make
    for server in reversed(started):
        await server.stop()


@pytest.fixture
async def server(make_server: ServerFactory, local_target: StoreTarget) -> RunningServer:
    """A server without tokens on a local store."""
    return await make_server(local_target)


@pytest.fixture
async def serve_app() -> AsyncIterator[Callable[[web.Application], Awaitable[str]]]:
    """Serve an aiohttp app (a stand-in service) on 127.0.0.1, any free port: its URL; cleaned up at teardown."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for r in runners:
        await r.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
