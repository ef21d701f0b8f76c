"""What vLLM gets from the plugin for names it cannot serve: None, or a clear error. No engine needed."""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm: make test-vllm")

from support import Mint, World, refused_url
from vllm.exceptions import GracefulHTTPError, VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolverRegistry

from engine_client.vllm_plugin import RESOLVER_NAME, AdapterUnavailable, MintResolver, PluginConfig, WrongBase
from engine_client.vllm_plugin.plugin import MintLoRAResolver, register


def test_the_entry_point_registers_the_resolver(mint: Mint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "mint_lora_resolver"]
    assert ep.load() is register
    monkeypatch.delenv("MINT_STORE", raising=False)
    monkeypatch.delenv("MINT_SERVER", raising=False)
    LoRAResolverRegistry.resolvers.pop(RESOLVER_NAME, None)
    register()  # nothing configured: nothing registered
    assert RESOLVER_NAME not in LoRAResolverRegistry.get_supported_resolvers()
    monkeypatch.setenv("MINT_SERVER", mint.server.url)
    monkeypatch.setenv("MINT_VLLM_CACHE_DIR", str(tmp_path / "cache"))
    register()
    resolver = LoRAResolverRegistry.get_resolver(RESOLVER_NAME)
    try:
        assert isinstance(resolver, MintLoRAResolver)
        req = asyncio.run(resolver.resolve_lora("/models/tiny-llama", "acme/a"))
        assert isinstance(req, LoRARequest)
        assert (req.lora_name, req.base_model_name) == ("acme/a", "/models/tiny-llama")
        # this vLLM takes rows directly: a row path, a function of the content alone, and no files
        assert req.lora_path == str(tmp_path / "cache" / "rows" / mint.content["acme/a"])
        assert not (tmp_path / "cache" / "entries").exists()
    finally:
        LoRAResolverRegistry.resolvers.pop(RESOLVER_NAME, None)
        resolver.resolver.close()
    monkeypatch.setenv("MINT_VLLM_LOAD", "files")  # the fallback, asked for
    register()
    resolver = LoRAResolverRegistry.get_resolver(RESOLVER_NAME)
    try:
        req = asyncio.run(resolver.resolve_lora("/models/tiny-llama", "acme/a"))
        assert req.lora_path == str(tmp_path / "cache" / "entries" / mint.content["acme/a"])
    finally:
        LoRAResolverRegistry.resolvers.pop(RESOLVER_NAME, None)
        resolver.resolver.close()


def test_this_vllm_takes_rows_directly_and_an_unsupported_one_falls_back_or_stops_vllm(
        mint: Mint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine_client.vllm_plugin import plugin
    from engine_client.vllm_plugin.compat import Support, check_vllm

    support = check_vllm()
    assert support.ok and support.tested, support  # the vLLM of make test-vllm
    config = PluginConfig(url=mint.server.url, cache_dir=tmp_path / "cache", load="direct")
    # a vLLM whose LoRA entry points moved: 'auto' falls back to files, 'direct' stops vLLM naming why
    monkeypatch.setattr(plugin, "check_vllm", lambda: Support("9.9.9", "vLLM 9.9.9 has no PEFTHelper.from_local_dir",
                                                              False))
    with pytest.raises(RuntimeError, match=r"MINT_VLLM_LOAD=direct, but vLLM 9\.9\.9 has no PEFTHelper"):
        plugin._install_direct(config)
    auto = PluginConfig(url=mint.server.url, cache_dir=tmp_path / "cache")
    assert plugin._install_direct(auto) is None


def make(url: str, cache: Path) -> MintLoRAResolver:
    return MintLoRAResolver(MintResolver(PluginConfig(url=url, cache_dir=cache)))


def test_unknown_names_give_none(world: World, mint: Mint, tmp_path: Path) -> None:
    r = make(mint.server.url, tmp_path / "cache")
    try:
        for name in ("acme/nope", "acme/a@7", "acme/a:nope", "gpt-4", "Acme/A", "sha:" + "0" * 32):
            assert asyncio.run(r.resolve_lora(str(world.model), name)) is None, name
    finally:
        r.resolver.close()


def test_a_wrong_base_is_a_400_naming_both_bases(world: World, mint: Mint, tmp_path: Path) -> None:
    r = make(mint.server.url, tmp_path / "cache")
    try:
        with pytest.raises(VLLMValidationError, match="other-model") as e:
            asyncio.run(r.resolve_lora(str(world.model), "acme/elsewhere"))
        assert "tiny-llama" in str(e.value) and isinstance(e.value.__cause__, WrongBase)
        with pytest.raises(VLLMValidationError, match="tiny-llama"):  # a model of another name
            asyncio.run(r.resolve_lora("/models/llama-3-8b", "acme/a"))
        assert not (tmp_path / "cache" / "entries").exists() or not any((tmp_path / "cache" / "entries").iterdir())
    finally:
        r.resolver.close()


def test_an_unreachable_store_is_a_503(world: World, tmp_path: Path) -> None:
    with refused_url() as dead:
        r = make(dead, tmp_path / "cache")
        try:
            with pytest.raises(GracefulHTTPError, match=dead) as e:
                asyncio.run(r.resolve_lora(str(world.model), "acme/a"))
            assert e.value.http_status == HTTPStatus.SERVICE_UNAVAILABLE
            assert isinstance(e.value.__cause__, AdapterUnavailable)
        finally:
            r.resolver.close()
