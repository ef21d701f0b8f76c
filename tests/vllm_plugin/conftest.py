"""Fixtures of the vLLM resolver tests: real PEFT adapters, a local store, a loopback service.

These tests need no vLLM: they drive :class:`engine_client.vllm_plugin.MintResolver`, the
logic behind the thin vLLM adapter (tests_vllm/ runs the real vLLM).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_client import SyncMintClient
from engine_client.vllm_plugin import MintResolver, PluginConfig
from mint_store.service import ServerThread, ServiceConfig
from mint_store.store import Store
from tests.support.vllm_plugin import ResolverFactory


@pytest.fixture(scope="session")
def peft_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three real PEFT adapters of the tiny Llama (seed-0 base): a and b differ only in weights."""
    from tests.support.hf_models import build_model, peft_model

    root = tmp_path_factory.mktemp("peft")
    out = []
    for name, seed, lora in (("a", 1, {"r": 4}), ("b", 2, {"r": 4}),
                             ("c", 3, {"r": 2, "target_modules": ["q_proj", "v_proj"]})):
        peft_model(build_model("llama", seed=0), seed=seed, **lora).save_pretrained(str(root / name))
        out.append(root / name)
    return out


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    (tmp_path / "uploads").mkdir()
    s = ServerThread(ServiceConfig(store=str(tmp_path / "served"), host="127.0.0.1", port=0,
                                     upload_dir=str(tmp_path / "uploads"), workers=2, auto_compact=False))
    yield s
    s.stop()


@pytest.fixture
def publisher(server: ServerThread) -> Iterator[SyncMintClient]:
    with SyncMintClient(server.url) as c:
        yield c


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "store") as s:
        yield s


@pytest.fixture
def make_resolver(tmp_path: Path) -> Iterator[ResolverFactory]:
    """``make_resolver(url, direct=False, **PluginConfig fields)``; all closed at teardown."""
    made: list[MintResolver] = []

    def make(url: str, *, direct: bool = False, **options: Any) -> MintResolver:
        options.setdefault("cache_dir", tmp_path / "cache")
        r = MintResolver(PluginConfig(url=url, **options), direct=direct)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()
