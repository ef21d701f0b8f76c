"""PEFT directories -> Adapter -> PEFT directories, checked against real PEFT models.

One file past ~450 lines on purpose: every case shares the PEFT round-trip helpers at its
top, and each test is a single format rule (rank_pattern, alpha_pattern, modules_to_save, ...).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from mint_store.errors import InvalidAdapter, UnsupportedAdapter
from mint_store.format.adapter import Adapter, LoraModule, make_adapter
from mint_store.peft.adapter_config import CONFIG_NAME, module_targeted, parse_config, pattern_key
from mint_store.peft.directory import (
    WEIGHTS_NAME,
    load_peft_dir,
    load_peft_files,
    peft_files,
    save_peft_dir,
    synthesize_config,
)
from tests.support.hf_models import (
    ATTN,
    EXPERTS,
    HIDDEN,
    MLA,
    MLP,
    MOE_INTER,
    MOE_PARAMS,
    build_model,
    load_peft,
    logits,
    make_peft_dir,
    peft_model,
)

LAYERS = (0, 1)


def _roundtrip(src: Path, tmp_path: Path, kind: str, dtype=torch.float32) -> Adapter:
    """src -> Adapter -> exported dir; PEFT gives bit-identical logits from both dirs."""
    adapter = load_peft_dir(src)
    out = save_peft_dir(adapter, tmp_path / "exported")
    want = logits(load_peft(src, kind, dtype=dtype))
    got = logits(load_peft(out, kind, dtype=dtype))
    assert torch.equal(want, got)
    # and the adapter is not a no-op, so the comparison means something
    assert not torch.equal(want, logits(build_model(kind, dtype=dtype)))
    return adapter


def _shapes(adapter: Adapter) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {m.name: (tuple(m.a.shape), tuple(m.b.shape)) for m in adapter.modules}


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("r", [1, 16])
def test_llama_dense_roundtrip(tmp_path, r):
    src = make_peft_dir(tmp_path / "src", "llama", r=r, lora_alpha=2 * r, target_modules=[*ATTN, *MLP])
    adapter = _roundtrip(src, tmp_path, "llama")
    out_sizes = {"q_proj": 32, "k_proj": 16, "v_proj": 16, "o_proj": 32, "gate_proj": 48, "up_proj": 48,
                 "down_proj": 32}
    in_sizes = dict.fromkeys(out_sizes, 32) | {"down_proj": 48}
    want = {
        f"model.layers.{i}.{'self_attn' if p in ATTN else 'mlp'}.{p}": ((r, in_sizes[p]), (out_sizes[p], r))
        for i in LAYERS
        for p in out_sizes
    }
    assert _shapes(adapter) == want
    assert [m.name for m in adapter.modules][:2] == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj"]
    assert all(m.scaling == 2.0 for m in adapter.modules)
    assert adapter.peft_config is not None and adapter.peft_config["r"] == r
    json.dumps(adapter.peft_config)  # serialisable as stored


def test_rank_and_alpha_patterns(tmp_path):
    rank_pattern = {"q_proj": 4, r"layers\.1\.self_attn\.v_proj": 2, "model.layers.0.mlp.down_proj": 3}
    alpha_pattern = {"o_proj": 3, r"layers\.0\..*k_proj": 7, "up_proj": 5}
    src = make_peft_dir(
        tmp_path / "src", "llama", r=8, lora_alpha=16, target_modules=[*ATTN, *MLP],
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
    )
    adapter = _roundtrip(src, tmp_path, "llama")
    from peft.tuners.lora import LoraLayer

    peft = load_peft(src, "llama")
    by_name = {m.name: m for m in adapter.modules}
    seen = 0
    for name, module in peft.base_model.model.named_modules():
        if isinstance(module, LoraLayer):
            seen += 1
            m = by_name[name]
            assert m.rank == module.r["default"], name
            assert m.scaling == module.scaling["default"], name  # same float arithmetic as peft
    assert seen == len(adapter.modules) == 14
    assert by_name["model.layers.1.self_attn.v_proj"].rank == 2
    assert by_name["model.layers.0.self_attn.v_proj"].rank == 8
    assert by_name["model.layers.0.self_attn.k_proj"].scaling == 7 / 8
    assert by_name["model.layers.1.self_attn.k_proj"].scaling == 16 / 8
    assert by_name["model.layers.0.self_attn.q_proj"].scaling == 16 / 4


def test_pattern_key_matches_peft():
    from peft.utils.other import get_pattern_key

    patterns = {"q_proj": 1, r"layers\.1\..*": 2, "mlp.down_proj": 3, "layers.0.mlp.up_proj": 4, "proj": 5}
    keys = [f"model.layers.{i}.{p}" for i in range(3) for p in
            ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj", "mlp.up_proj", "mlp.experts.gate_up_proj")]
    for key in keys:
        assert pattern_key(patterns, key) == get_pattern_key(patterns.keys(), key), key


@pytest.mark.parametrize(
    "extra",
    [
        {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]},
        {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": 0, "layers_pattern": "layers"},
        {"target_modules": ["self_attn.q_proj", "mlp.up_proj"], "exclude_modules": ["layers.0.mlp.up_proj"]},
        {"target_modules": r".*\.(q|v)_proj", "exclude_modules": r".*\.1\.self_attn\.v_proj"},
        {"target_modules": "all-linear"},
    ],
)
def test_module_targeting_matches_peft(tmp_path, extra):
    from peft.tuners.tuners_utils import check_target_module_exists

    config = json.loads(json.dumps({"peft_type": "LORA", **extra}))
    _, settings = parse_config(config)
    peft_config = peft_model(build_model("llama"), **extra).peft_config["default"]
    linear = [n for n, m in build_model("llama").named_modules() if isinstance(m, torch.nn.Linear)]
    for name in linear:
        if name == "lm_head" and extra["target_modules"] == "all-linear":
            continue  # peft drops the output head when resolving all-linear; a file never has it
        assert module_targeted(settings, name) == bool(check_target_module_exists(peft_config, name)), name
    src = make_peft_dir(tmp_path / "src", "llama", **extra)
    _roundtrip(src, tmp_path, "llama")


def test_rslora(tmp_path):
    src = make_peft_dir(tmp_path / "src", "qwen3", r=4, lora_alpha=8, use_rslora=True, target_modules=ATTN)
    adapter = _roundtrip(src, tmp_path, "qwen3")
    assert {m.scaling for m in adapter.modules} == {8 / 4**0.5}


def test_bf16_adapter(tmp_path):
    src = make_peft_dir(tmp_path / "src", "mistral", dtype=torch.bfloat16, r=4, target_modules=[*ATTN, *MLP])
    assert {t.dtype for t in load_file(src / WEIGHTS_NAME).values()} == {torch.bfloat16}
    adapter = _roundtrip(src, tmp_path, "mistral", dtype=torch.bfloat16)
    assert {m.a.dtype for m in adapter.modules} == {m.b.dtype for m in adapter.modules} == {torch.bfloat16}
    exported = load_file(tmp_path / "exported" / WEIGHTS_NAME)
    original = load_file(src / WEIGHTS_NAME)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def _moe_shapes(r: int, layers=LAYERS) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {
        **{f"model.layers.{i}.mlp.experts.gate_up_proj": ((EXPERTS, r, HIDDEN), (EXPERTS, 2 * MOE_INTER, r))
           for i in layers},
        **{f"model.layers.{i}.mlp.experts.down_proj": ((EXPERTS, r, MOE_INTER), (EXPERTS, HIDDEN, r))
           for i in layers},
    }


def test_qwen3_moe_expert_params(tmp_path):
    src = make_peft_dir(tmp_path / "src", "qwen3_moe", r=2, lora_alpha=4, target_modules=[],
                        target_parameters=MOE_PARAMS)
    adapter = _roundtrip(src, tmp_path, "qwen3_moe")
    assert _shapes(adapter) == _moe_shapes(2)
    assert adapter.layout.modules[0].experts == EXPERTS
    exported = load_file(tmp_path / "exported" / WEIGHTS_NAME)
    original = load_file(src / WEIGHTS_NAME)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_qwen3_moe_experts_with_attention_and_patterns(tmp_path):
    src = make_peft_dir(
        tmp_path / "src", "qwen3_moe", r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
        target_parameters=MOE_PARAMS, rank_pattern={"layers.1.mlp.experts.down_proj": 3},
        alpha_pattern={"gate_up_proj": 5},
    )
    adapter = _roundtrip(src, tmp_path, "qwen3_moe")
    shapes = _shapes(adapter)
    assert shapes["model.layers.1.mlp.experts.down_proj"] == ((EXPERTS, 3, MOE_INTER), (EXPERTS, HIDDEN, 3))
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == ((EXPERTS, 4, HIDDEN), (EXPERTS, 48, 4))
    assert shapes["model.layers.0.self_attn.q_proj"] == ((4, HIDDEN), (32, 4))
    scaling = {m.name: m.scaling for m in adapter.modules}
    assert scaling["model.layers.0.mlp.experts.gate_up_proj"] == 5 / 4
    assert scaling["model.layers.1.mlp.experts.down_proj"] == 8 / 3


def test_peft_s_own_moe_conversion_with_bare_parameter_names(tmp_path):
    """PEFT rewrites target_modules [q, v, gate, up, down] on a fused-experts model into
    target_modules [q, v] + target_parameters ['down_proj', 'gate_up_proj'] (bare names) and a
    doubled rank for gate_up. A bare name selects a parameter of that name, never a module
    target_modules selects: q_proj stays a dense LoRA with its own scaling."""
    src = make_peft_dir(tmp_path / "src", "qwen3_moe", r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    config = json.loads((src / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"]  # bare, as PEFT wrote them
    adapter = _roundtrip(src, tmp_path, "qwen3_moe")
    shapes = _shapes(adapter)
    assert shapes["model.layers.0.self_attn.q_proj"] == ((4, HIDDEN), (32, 4))
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == ((EXPERTS, 8, HIDDEN), (EXPERTS, 2 * MOE_INTER, 8))
    assert shapes["model.layers.0.mlp.experts.down_proj"] == ((EXPERTS, 4, MOE_INTER), (EXPERTS, HIDDEN, 4))
    assert {m.scaling for m in adapter.modules} == {2.0}  # 8/4 dense and down, 16/8 for the doubled gate_up


def test_qwen3_moe_down_proj_only(tmp_path):
    src = make_peft_dir(tmp_path / "src", "qwen3_moe", r=2, target_modules=[],
                        target_parameters=["mlp.experts.down_proj"])
    adapter = _roundtrip(src, tmp_path, "qwen3_moe")
    assert _shapes(adapter) == {k: v for k, v in _moe_shapes(2).items() if k.endswith("down_proj")}


def test_deepseek_v3_mla_and_experts(tmp_path):
    src = make_peft_dir(tmp_path / "src", "deepseek_v3", r=2, target_modules=list(MLA),
                        target_parameters=MOE_PARAMS)
    adapter = _roundtrip(src, tmp_path, "deepseek_v3")
    shapes = _shapes(adapter)
    assert {k: v for k, v in shapes.items() if ".experts." in k} == _moe_shapes(2, layers=(1,))
    assert shapes["model.layers.0.self_attn.kv_b_proj"] == ((2, 16), (64, 2))


def test_target_parameters_on_a_2d_weight(tmp_path):
    src = make_peft_dir(tmp_path / "src", "llama", r=2, target_modules=["v_proj"],
                        target_parameters=["self_attn.q_proj.weight"])
    adapter = _roundtrip(src, tmp_path, "llama")
    shapes = _shapes(adapter)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ((1, 2, HIDDEN), (1, 32, 2))
    assert shapes["model.layers.0.self_attn.v_proj"] == ((2, HIDDEN), (16, 2))


def _expert_wrappers(peft) -> dict[str, object]:
    from peft.tuners.lora.layer import ParamWrapper

    out = {}
    for name, module in peft.base_model.model.named_modules():
        if isinstance(module, ParamWrapper):
            path = re.sub(r"(\.base_layer)+$", "", name)
            out[f"{path}.{module.parameter_name}"] = module
    return out


def test_moe_conversion_matches_peft_math(tmp_path):
    """Canonical [E,r,in] / [E,out,r] applied by hand == what PEFT's ParamWrapper adds."""
    src = make_peft_dir(tmp_path / "src", "qwen3_moe", r=3, lora_alpha=5, target_modules=["q_proj"],
                        target_parameters=MOE_PARAMS)
    adapter = load_peft_dir(src)
    peft = load_peft(src, "qwen3_moe")
    wrappers = _expert_wrappers(peft)
    experts = [m for m in adapter.modules if m.experts]
    assert sorted(wrappers) == sorted(m.name for m in experts)
    for m in experts:
        peft_delta = wrappers[m.name].get_delta_weight("default")
        assert peft_delta.shape == build_model("qwen3_moe").get_parameter(m.name).shape
        for e in range(EXPERTS):
            by_hand = m.scaling * (m.b[e] @ m.a[e])  # [out, in], same orientation as W_e
            torch.testing.assert_close(peft_delta[e], by_hand, rtol=1e-5, atol=1e-7)

    # forward: a base model whose weights carry the hand-made deltas == PEFT's forward
    base = build_model("qwen3_moe")
    with torch.no_grad():
        for m in adapter.modules:
            if m.experts:
                base.get_parameter(m.name).add_(m.scaling * torch.bmm(m.b, m.a))
            else:
                base.get_submodule(m.name).weight.add_(m.scaling * (m.b @ m.a))
    torch.testing.assert_close(logits(base), logits(peft), rtol=1e-4, atol=1e-5)
    # and merging in PEFT gives the same weights
    merged = peft.merge_and_unload()
    for m in experts:
        torch.testing.assert_close(merged.get_parameter(m.name), base.get_parameter(m.name), rtol=1e-5,
                                   atol=1e-6)


# ---------------------------------------------------------------- other entry points


def test_load_peft_files_bytes_and_dict(tmp_path):
    src = make_peft_dir(tmp_path / "src", "llama", r=2)
    config = (src / CONFIG_NAME).read_bytes()
    weights = (src / WEIGHTS_NAME).read_bytes()
    a = load_peft_dir(src, base="llama-tiny")
    b = load_peft_files(config, weights, base="llama-tiny")
    c = load_peft_files(json.loads(config), src / WEIGHTS_NAME, base="llama-tiny")
    assert a.base == "llama-tiny"
    assert a.content_id() == b.content_id() == c.content_id()
    assert a.peft_config == b.peft_config == c.peft_config == json.loads(config)
    cfg, weights2 = peft_files(a)
    assert json.loads(cfg) == json.loads(config)
    assert load_peft_files(cfg, weights2, base="llama-tiny").content_id() == a.content_id()


def test_row_roundtrip_keeps_exact_outputs(tmp_path):
    """What the store does: Adapter -> row -> Adapter(from_row, peft_config) -> PEFT files."""
    src = make_peft_dir(tmp_path / "src", "qwen3_moe", r=3, lora_alpha=7, target_modules=["q_proj", "v_proj"],
                        target_parameters=MOE_PARAMS, alpha_pattern={"v_proj": 11})
    adapter = load_peft_dir(src)
    layout, row = adapter.to_row()
    back = Adapter.from_row(layout, row.copy(), peft_config=adapter.peft_config)
    out = save_peft_dir(back, tmp_path / "from_row")
    assert torch.equal(logits(load_peft(src, "qwen3_moe")), logits(load_peft(out, "qwen3_moe")))


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_export_without_config_synthesises_one(tmp_path, kind):
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                rank_pattern={"v_proj": 2}, alpha_pattern={"layers.1.self_attn.q_proj": 3})
    if kind == "qwen3_moe":
        lora |= dict(target_modules=["q_proj", "v_proj"], target_parameters=MOE_PARAMS)
    src = make_peft_dir(tmp_path / "src", kind, **lora)
    loaded = load_peft_dir(src)
    bare = make_adapter(list(loaded.modules))  # as if built from tensors: no peft_config
    assert bare.peft_config is None
    config = synthesize_config(bare)
    assert config["r"] == 4 and config["rank_pattern"] == {
        re.escape(f"model.layers.{i}.self_attn.v_proj"): 2 for i in LAYERS
    }
    out = save_peft_dir(bare, tmp_path / "bare")
    again = load_peft_dir(out)
    assert [(m.name, m.scaling) for m in again.modules] == [(m.name, m.scaling) for m in loaded.modules]
    torch.testing.assert_close(logits(load_peft(out, kind)), logits(load_peft(src, kind)), rtol=0, atol=1e-6)


def test_export_refuses_config_that_disagrees(tmp_path):
    src = make_peft_dir(tmp_path / "src", "llama", r=2, lora_alpha=4)
    adapter = load_peft_dir(src)
    wrong_alpha = Adapter(adapter.base, adapter.modules, {**adapter.peft_config, "lora_alpha": 8})
    with pytest.raises(InvalidAdapter, match=r"scaling 4\.0 but the adapter has 2\.0; drop peft_config"):
        peft_files(wrong_alpha)
    fewer_targets = Adapter(adapter.base, adapter.modules, {**adapter.peft_config, "target_modules": ["q_proj"]})
    with pytest.raises(InvalidAdapter, match="do not select it"):
        peft_files(fewer_targets)


# ---------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_peft_dir(tmp_path_factory.mktemp("llama") / "src", "llama", r=4, target_modules=["q_proj", "v_proj"])


def _files(d: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((d / CONFIG_NAME).read_text()), load_file(d / WEIGHTS_NAME)


def _load(config: dict, tensors: dict[str, torch.Tensor]) -> Adapter:
    return load_peft_files(json.dumps(config).encode(), save(tensors))


KEY = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("use_dora", True, "DoRA"),
        ("modules_to_save", ["lm_head"], "modules_to_save"),
        ("trainable_token_indices", [1, 2], "trainable_token_indices"),
        ("layer_replication", [[0, 1], [0, 2]], "layer_replication"),
        ("megatron_config", {"tensor_model_parallel_size": 2}, "megatron_config"),
        ("lora_bias", True, "lora_bias"),
        ("use_qalora", True, "QA-LoRA"),
        ("alora_invocation_tokens", [5, 6], "alora_invocation_tokens"),
        ("arrow_config", {"top_k": 2}, "arrow_config"),
        ("velora_config", {"rank": 2}, "velora_config"),
        ("monteclora_config", {"n": 2}, "monteclora_config"),
        ("kasa_config", {"x": 1}, "kasa_config"),
        ("use_bdlora", {"nblocks": 2}, "use_bdlora"),
        ("peft_type", "IA3", "only LoRA adapters"),
        ("init_lora_weights", "pissa", "rewrites the base weights"),
        ("init_lora_weights", "olora", "rewrites the base weights"),
        ("some_future_field", {"on": True}, "unknown to this store"),
    ],
)
def test_refused_config_features(llama_dir, field, value, message):
    config, tensors = _files(llama_dir)
    with pytest.raises(UnsupportedAdapter, match=message):
        _load({**config, field: value}, tensors)


@pytest.mark.parametrize(("field", "value"), [("some_future_field", None), ("some_future_field", False),
                                              ("init_lora_weights", "gaussian"), ("lora_dropout", 0.1),
                                              ("task_type", "CAUSAL_LM"), ("bias", "all")])
def test_inert_config_fields_accepted(llama_dir, field, value):
    config, tensors = _files(llama_dir)
    assert _load({**config, field: value}, tensors).peft_config[field] == value


def test_real_dora_adapter_refused(tmp_path):
    src = make_peft_dir(tmp_path / "dora", "llama", r=2, use_dora=True)
    with pytest.raises(UnsupportedAdapter, match="DoRA"):
        load_peft_dir(src)
    config, tensors = _files(src)
    assert any("lora_magnitude_vector" in k for k in tensors)
    with pytest.raises(UnsupportedAdapter, match="DoRA magnitude vectors"):
        _load({**config, "use_dora": False}, tensors)


def test_real_embedding_adapter_refused(tmp_path):
    src = make_peft_dir(tmp_path / "emb", "llama", r=2, target_modules=["embed_tokens", "q_proj"])
    with pytest.raises(UnsupportedAdapter, match="embedding LoRA is not supported"):
        load_peft_dir(src)
    config, tensors = _files(src)
    assert any("lora_embedding_A" in k for k in tensors)
    with pytest.raises(UnsupportedAdapter, match="lora_embedding_A/B"):
        _load({**config, "target_modules": ["q_proj"]}, tensors)


def test_real_lora_bias_adapter_refused(tmp_path):
    src = make_peft_dir(tmp_path / "lb", "llama", r=2, lora_bias=True)
    with pytest.raises(UnsupportedAdapter, match="lora_bias"):
        load_peft_dir(src)
    config, tensors = _files(src)
    with pytest.raises(UnsupportedAdapter, match="LoRA biases"):
        _load({**config, "lora_bias": False}, tensors)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (f"{KEY}.bias", "trained base biases"),
        ("base_model.model.lm_head.modules_to_save.weight", "modules_to_save"),
        ("base_model.model.model.embed_tokens.trainable_tokens_delta", "trainable token"),
        (f"{KEY}.lora_C.weight", "full weights of a base module"),
        (f"{KEY}.lora_A.bias", "LoRA biases"),
        (f"{KEY}.lora_A.default.weight", "full weights"),
        ("optimizer_state", "not a PEFT LoRA weight"),
    ],
)
def test_unknown_or_refused_tensor_keys(llama_dir, key, message):
    config, tensors = _files(llama_dir)
    with pytest.raises(UnsupportedAdapter, match=message):
        _load(config, {**tensors, key: torch.zeros(4)})


@pytest.mark.parametrize("drop", ["lora_A", "lora_B"])
def test_half_a_module(llama_dir, drop):
    config, tensors = _files(llama_dir)
    del tensors[f"{KEY}.{drop}.weight"]
    keep = "lora_B" if drop == "lora_A" else "lora_A"
    with pytest.raises(InvalidAdapter, match=f"has {keep} but no {drop}; every LoRA module needs both") as e:
        _load(config, tensors)
    assert not isinstance(e.value, UnsupportedAdapter)


def test_config_targets_module_the_file_lacks(llama_dir):
    config, tensors = _files(llama_dir)
    with pytest.raises(InvalidAdapter, match="target_modules names 'k_proj' but the file has no LoRA tensors"):
        _load({**config, "target_modules": ["q_proj", "v_proj", "k_proj"]}, tensors)


def test_tensors_the_config_does_not_target(llama_dir):
    config, tensors = _files(llama_dir)
    with pytest.raises(InvalidAdapter, match="v_proj' but the config's target_modules/target_parameters do not"):
        _load({**config, "target_modules": ["q_proj"]}, tensors)
    with pytest.raises(InvalidAdapter, match="do not select it"):
        _load({**config, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["layers.1.self_attn.q_proj"]},
              tensors)


def test_config_targets_parameter_the_file_lacks(tmp_path):
    src = make_peft_dir(tmp_path / "moe", "qwen3_moe", r=2, target_modules=[],
                        target_parameters=["mlp.experts.down_proj"])
    config, tensors = _files(src)
    with pytest.raises(InvalidAdapter, match="gate_up_proj'] but the file has no LoRA tensors"):
        _load({**config, "target_parameters": list(MOE_PARAMS)}, tensors)
    with pytest.raises(InvalidAdapter, match=r"select \['model.layers.0.mlp.experts.up_proj'\] but the file"):
        _load({**config, "target_parameters": ["mlp.experts.down_proj", "mlp.experts.up_proj"]},
              {k: v for k, v in tensors.items() if "layers.0" in k})


def test_moe_rank_must_divide_rows(tmp_path):
    src = make_peft_dir(tmp_path / "moe", "qwen3_moe", r=2, target_modules=[],
                        target_parameters=["mlp.experts.down_proj"])
    config, tensors = _files(src)
    with pytest.raises(InvalidAdapter, match=r"expected \[r\*experts, in\] and \[out, r\*experts\] with r=3"):
        _load({**config, "r": 3}, tensors)


def test_moe_unknown_nesting_refused(tmp_path):
    src = make_peft_dir(tmp_path / "moe", "qwen3_moe", r=2, target_modules=[], target_parameters=MOE_PARAMS)
    config, tensors = _files(src)
    renamed = {"target_parameters": ["mlp.experts.w1", "mlp.experts.w2"]}
    with pytest.raises(UnsupportedAdapter, match="nesting order"):
        _load({**config, **renamed}, tensors)


def test_moe_nesting_shape_check(tmp_path):
    src = make_peft_dir(tmp_path / "moe", "qwen3_moe", r=2, target_modules=[], target_parameters=MOE_PARAMS)
    config, tensors = _files(src)
    # swap which level is which: the shapes no longer chain like gate_up -> down
    swapped = {k.replace(".base_layer.", ".TMP.").replace("experts.lora", "experts.base_layer.lora")
               .replace(".TMP.", "."): v for k, v in tensors.items()}
    with pytest.raises(InvalidAdapter, match="not nested in the order"):
        _load(config, swapped)


def test_rank_disagrees_with_config(llama_dir):
    config, tensors = _files(llama_dir)
    with pytest.raises(InvalidAdapter, match=r"config gives rank 8 .* but lora_A is \(4, 32\)"):
        _load({**config, "r": 8}, tensors)


def test_a_b_rank_mismatch(llama_dir):
    config, tensors = _files(llama_dir)
    tensors[f"{KEY}.lora_B.weight"] = tensors[f"{KEY}.lora_B.weight"][:, :3].contiguous()
    with pytest.raises(InvalidAdapter, match=r"config gives rank 4 .* lora_B \(32, 3\)"):
        _load(config, tensors)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values(llama_dir, value):
    config, tensors = _files(llama_dir)
    tensors[f"{KEY}.lora_A.weight"][1, 2] = value
    with pytest.raises(InvalidAdapter, match=r"'model\.layers\.0\.self_attn\.q_proj' has NaN or Inf values"):
        _load(config, tensors)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_unsupported_dtype(llama_dir, dtype):
    config, tensors = _files(llama_dir)
    tensors[f"{KEY}.lora_A.weight"] = tensors[f"{KEY}.lora_A.weight"].to(dtype)
    with pytest.raises(UnsupportedAdapter, match=r"unsupported dtype (F64|I32)"):
        _load(config, tensors)


def test_conv_lora_refused(llama_dir):
    config, tensors = _files(llama_dir)
    tensors[f"{KEY}.lora_A.weight"] = torch.zeros(4, 32, 1, 1)
    with pytest.raises(UnsupportedAdapter, match="convolution LoRA is not supported"):
        _load(config, tensors)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"r": 0}, "r must be a positive integer"),
        ({"r": True}, "r must be a positive integer"),
        ({"r": "4"}, "r must be a positive integer"),
        ({"lora_alpha": "16"}, "lora_alpha must be a finite number"),
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern"),
        ({"rank_pattern": {"(": 2}}, "not a valid regular expression"),
        ({"rank_pattern": ["q_proj"]}, "must be an object"),
        ({"target_modules": None}, "neither target_modules nor target_parameters"),
        ({"target_modules": [1]}, "target_modules must be a string or a list"),
        ({"target_parameters": "mlp.experts.down_proj"}, "target_parameters must be a list"),
        ({"use_rslora": "yes"}, "use_rslora must be true or false"),
        ({"bias": "some"}, "not a PEFT bias mode"),
        ({"layers_to_transform": ["0"]}, "layers_to_transform must be"),
        ({"layers_pattern": "lay(ers"}, "not a valid regular expression"),
        ({"target_modules": "q_proj("}, "not a valid regular expression"),
    ],
)
def test_bad_config_values(llama_dir, patch, message):
    config, tensors = _files(llama_dir)
    with pytest.raises(InvalidAdapter, match=message):
        _load({**config, **patch}, tensors)


def test_bad_config_documents(llama_dir):
    _, tensors = _files(llama_dir)
    blob = save(tensors)
    with pytest.raises(InvalidAdapter, match="not valid JSON"):
        load_peft_files(b"{", blob)
    with pytest.raises(InvalidAdapter, match="must be a JSON object"):
        load_peft_files(b"[]", blob)
    with pytest.raises(InvalidAdapter, match="not JSON-serialisable"):
        load_peft_files({"peft_type": "LORA", "r": torch.tensor(1)}, blob)


def test_directory_problems(tmp_path, llama_dir):
    with pytest.raises(InvalidAdapter, match="does not exist"):
        load_peft_dir(tmp_path / "missing")
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(InvalidAdapter, match="is not a directory"):
        load_peft_dir(tmp_path / "a-file")
    d = tmp_path / "bin_only"
    d.mkdir()
    (d / CONFIG_NAME).write_bytes((llama_dir / CONFIG_NAME).read_bytes())
    (d / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(UnsupportedAdapter, match="safe_serialization=True"):
        load_peft_dir(d)
    (d / "adapter_model.bin").unlink()
    with pytest.raises(InvalidAdapter, match=f"has no {WEIGHTS_NAME}"):
        load_peft_dir(d)
    (d / CONFIG_NAME).unlink()
    save_file(load_file(llama_dir / WEIGHTS_NAME), d / WEIGHTS_NAME)
    with pytest.raises(InvalidAdapter, match=f"cannot read {CONFIG_NAME}"):
        load_peft_dir(d)


def test_truncated_weights_refused(llama_dir):
    config = (llama_dir / CONFIG_NAME).read_bytes()
    with pytest.raises(InvalidAdapter, match="truncated"):
        load_peft_files(config, (llama_dir / WEIGHTS_NAME).read_bytes()[:-10])


def test_make_adapter_modules_export_without_moe_names(tmp_path):
    """Tensors from Python with unknown fused-parameter names on one module cannot be nested."""
    a = torch.randn(2, 2, 8) * 0.1
    b = torch.randn(2, 8, 2) * 0.1
    adapter = make_adapter([LoraModule("m.experts.w1", a, b, 1.0), LoraModule("m.experts.w2", a, b, 1.0)])
    with pytest.raises(UnsupportedAdapter, match="nesting order"):
        peft_files(adapter)
