"""One base-compatibility rule for the engine and the vLLM plugin (engine_client.engine.base_compat)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine_client.engine.base_compat import base_refusal
from engine_client.errors import LayoutMismatch
from engine_client.vllm_plugin.bases import base_mismatch
from mint_store.peft.directory import load_peft_dir
from tests.support.engine import TENANT, open_engine
from tests.support.hf_models import ATTN, build_model, load_peft, logits, make_peft_dir, sample_ids

IDS = sample_ids(batch=2, seq=4, seed=3)


@pytest.mark.parametrize(("adapter", "served", "ok"), [
    ("tiny-llama", "tiny-llama", True),
    ("qwen3-4b", "tiny-llama", False),
    ("unspecified", "tiny-llama", False),  # declared base: nothing vouches for an adapter without one
    ("unspecified", None, True),  # no declared base: shapes decide (checked elsewhere)
    ("qwen3-4b", None, True),
])
def test_one_rule_for_engine_and_vllm(adapter: str, served: str | None, ok: bool) -> None:
    assert (base_refusal(adapter, served) is None) is ok
    if served is not None:  # the plugin (which always declares a base) answers the same
        assert (base_mismatch(adapter, f"/models/{served}") is None) is ok
    if adapter == "unspecified" and not ok:
        assert f"--base {served}" in str(base_refusal(adapter, served))  # the refusal names the fix


def test_an_engine_with_a_base_refuses_an_adapter_without_one(local_target: Any, tmp_path: Path) -> None:
    peft = make_peft_dir(tmp_path / "v1", "llama", r=4, lora_alpha=8, target_modules=ATTN)
    with local_target.open() as store:
        store.publish(TENANT, "nobase", load_peft_dir(peft))  # base "unspecified"
    with open_engine(build_model("llama"), local_target, base="tiny-llama") as engine:
        with pytest.raises(LayoutMismatch, match=r"'t/nobase'.*without a base.*--base tiny-llama"):
            engine.forward(IDS, adapters=["t/nobase", None])
        assert all(p.available() == p.slots for p in engine.pools.values())  # nothing pinned or loaded
    # an engine that declares no base checks shapes only: the same adapter runs, exactly as PEFT
    with open_engine(build_model("llama"), local_target) as engine, torch.no_grad():
        out = engine.forward(IDS, adapters=["t/nobase", "t/nobase"]).logits
    assert (out - logits(load_peft(peft, "llama"), IDS)).abs().max().item() <= 1e-5
