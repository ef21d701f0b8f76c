"""Names the vLLM resolver tests share (fixtures are in tests/vllm_plugin/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

from engine_client.vllm_plugin import MintResolver

BASE = "tiny-llama"
MODEL = f"/models/{BASE}"  # what vLLM would pass as base_model_name

ResolverFactory = Callable[..., MintResolver]  # the make_resolver fixture
