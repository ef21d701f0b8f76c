"""Hostile adapter configs and safetensors headers, library level (issue 12, items 3, 4 and 9).

Patterns that make Python's backtracking ``re`` run for ever are matched by RE2 in linear
time with PEFT's answers, or refused with InvalidAdapter naming the key; numeric fields
that would overflow float32, integers past the 4,300-digit limit, zero-sized shapes with
huge dimensions and over-long names are InvalidAdapter, never another exception.

Checks that hung on the old code run in a subprocess with a generous join timeout (a
liveness check, not a performance threshold): the answer is asserted, not the time.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch
from safetensors.torch import save

from mint_store.errors import InvalidAdapter, LimitExceeded
from mint_store.peft.adapter_config import module_targeted, parse_config, pattern_key
from mint_store.peft.directory import load_peft_files, parse_key
from mint_store.peft.patterns import MAX_PATTERN_CHARS, MAX_REGEX_KEYS, MAX_TENSOR_NAME_CHARS

LIVENESS_S = float(os.environ.get("MINT_TEST_LIVENESS_S", 120))  # generous: the fixed code answers at once
RUN = "a" * 40  # 2**40 ways for (a+)+ to split it: the old re never finished
PREFIX = "base_model.model."


def _tensors(paths: list[str], r: int = 2, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for p in paths:
        out[f"{PREFIX}{p}.lora_A.weight"] = torch.randn(r, n, generator=g)
        out[f"{PREFIX}{p}.lora_B.weight"] = torch.randn(n, r, generator=g)
    return out


def _config(**fields: Any) -> dict[str, Any]:
    return {"peft_type": "LORA", "r": 2, "lora_alpha": 4, **fields}


def _load(config: dict[str, Any] | bytes, paths: list[str]) -> Any:
    return load_peft_files(config, save(_tensors(paths)))


def _in_subprocess(body: str) -> dict[str, Any]:
    """Run ``body`` (which sets ``result``) in a fresh interpreter; liveness-checked, JSON back."""
    code = "import json\n" + textwrap.dedent(body) + "\nprint('RESULT ' + json.dumps(result))\n"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=LIVENESS_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"did not finish within {LIVENESS_S} s: matching is not bounded")
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return dict(json.loads(lines[-1][len("RESULT ") :]))


_RUNNER = """
    import torch
    from safetensors.torch import save
    from mint_store.errors import InvalidAdapter
    from mint_store.peft.directory import load_peft_files
    config, paths = json.loads({args!r})
    tensors = {{}}
    for p in paths:
        tensors[f"base_model.model.{{p}}.lora_A.weight"] = torch.ones(2, 4)
        tensors[f"base_model.model.{{p}}.lora_B.weight"] = torch.ones(4, 2)
    try:
        a = load_peft_files(config, save(tensors))
        result = {{"modules": {{m.name: [m.rank, m.scaling] for m in a.modules}}}}
    except InvalidAdapter as e:
        result = {{"error": type(e).__name__, "message": str(e)}}
"""


def _load_in_subprocess(config: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    return _in_subprocess(_RUNNER.format(args=json.dumps([config, paths])))


# ---------------------------------------------------------------- item 3: patterns


CATASTROPHIC = r"model\.layers\.0\.(a+)+b"  # exponential in Python's re on a run of a's without b
MODULE = f"model.layers.0.{RUN}"
OTHER = "model.layers.0.q"


@pytest.mark.parametrize(
    ("case", "config", "paths", "want"),
    [
        # matched by RE2 in linear time, with PEFT's answer: the second alternative selects it
        ("target_modules", _config(target_modules=f"{CATASTROPHIC}|model\\.layers\\.0\\.a+"), [MODULE],
         {MODULE: [2, 2.0]}),
        # exclude_modules does not match, so the named module stays
        ("exclude_modules", _config(target_modules=[RUN], exclude_modules=CATASTROPHIC), [MODULE],
         {MODULE: [2, 2.0]}),
        # a rank_pattern / alpha_pattern key that matches nothing leaves r and lora_alpha
        ("rank_pattern", _config(target_modules=[RUN, "q"], rank_pattern={"(a+)+b": 3}), [MODULE, OTHER],
         {MODULE: [2, 2.0], OTHER: [2, 2.0]}),
        ("alpha_pattern", _config(target_modules=[RUN], alpha_pattern={"(a+)+b": 8, "q": 6}), [MODULE],
         {MODULE: [2, 2.0]}),
        # PEFT tries each layers_pattern in turn: the catastrophic one fails, "layers" finds index 0
        ("layers_pattern", _config(target_modules=[RUN], layers_to_transform=[0],
                                   layers_pattern=["(a+)+b", "layers"]), [MODULE], {MODULE: [2, 2.0]}),
    ],
)
def test_catastrophic_patterns_match_in_linear_time(case, config, paths, want):
    got = _load_in_subprocess(config, paths)
    assert got == {"modules": want}, case


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("target_modules", r"(?=model).*q_proj", "target_modules"),
        ("exclude_modules", r"(\w+)\.\1", "exclude_modules"),
        ("rank_pattern", {r"(q)_pro(?!x)j": 3}, "rank_pattern key"),
        ("alpha_pattern", {r"(?<=self_attn\.)q_proj": 8}, "alpha_pattern key"),
        ("layers_pattern", r"(?>layers)", "layers_pattern"),
    ],
)
def test_backtracking_only_syntax_is_refused_naming_the_key(field, value, shown):
    config = _config(target_modules=["q_proj"]) | {field: value}
    with pytest.raises(InvalidAdapter, match=re.escape(shown) + ".*linear time"):
        _load(config, ["model.layers.0.self_attn.q_proj"])


@pytest.mark.parametrize(
    "config",
    [
        _config(target_modules="q" * (MAX_PATTERN_CHARS + 1)),
        _config(target_modules=["q_proj"], rank_pattern={"q" * (MAX_PATTERN_CHARS + 1): 4}),
        _config(target_modules=["q_proj"], alpha_pattern={f"x{i}|y": 4 for i in range(MAX_REGEX_KEYS + 1)}),
        # counted before any is compiled (a config of 80,000 keys took seconds of compiling): the
        # first key, not a valid expression, is never reached
        _config(target_modules=["q_proj"], rank_pattern={"(": 4} | {f"x{i}|y": 4 for i in range(MAX_REGEX_KEYS)}),
        _config(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern=[f"l{i}" for i in range(65)]),
        # short text, but ~3,000 RE2 instructions: each match over a long module path costs ~100 ms
        _config(target_modules=["q_proj"], rank_pattern={"(?:[ab.]*b){1000}x0": 4}),
    ],
    ids=["long target regex", "long rank key", "too many regex keys", "counted before compiled",
         "too many layers patterns", "huge compiled pattern"],
)
def test_pattern_sizes_and_counts_are_bounded(config):
    with pytest.raises(LimitExceeded, match="over the limit"):
        _load(config, ["model.layers.0.self_attn.q_proj"])


def test_long_tensor_name_is_refused_at_once():
    # '.base_layer' repeated: the old lazy key regex backtracked quadratically over it
    key = "x" + ".base_layer" * 9_000 + ".lora_A.weightX"
    got = _in_subprocess(f"""
        from mint_store.errors import InvalidAdapter
        from mint_store.peft.directory import parse_key
        try:
            parse_key({key!r})
            result = {{"error": None}}
        except InvalidAdapter as e:
            result = {{"error": str(e)}}
    """)
    assert len(key) > 90_000
    assert f"over the limit of {MAX_TENSOR_NAME_CHARS}" in got["error"]


def test_long_tensor_name_in_a_file_is_refused():
    name = "model." + "a" * 100_000
    with pytest.raises(InvalidAdapter, match=f"tensor name of {len(PREFIX + name) + 14} characters is over the "
                                             f"limit of {MAX_TENSOR_NAME_CHARS}"):
        _load(_config(target_modules=["q"]), [name])


@pytest.mark.slow
def test_many_targets_times_many_modules_is_linear():
    # 10k modules x 300k listed names: the old per-module scan of every name did ~3e9
    # endswith calls; lookups by dotted suffix make it one set probe per suffix
    got = _in_subprocess("""
        import torch
        from safetensors.torch import save
        from mint_store.errors import InvalidAdapter
        from mint_store.peft.directory import load_peft_files
        paths = [f"model.layers.{i}.proj" for i in range(10_000)]
        # full paths, dotted suffixes, and names the file lacks: the answer names the first of those
        targets = paths + [p.split(".", 1)[1] for p in paths] + [f"m{i}.layers.{i}.proj" for i in range(280_000)]
        tensors = {}
        for p in paths:
            tensors[f"base_model.model.{p}.lora_A.weight"] = torch.ones(1, 1)
            tensors[f"base_model.model.{p}.lora_B.weight"] = torch.ones(1, 1)
        try:
            load_peft_files({"peft_type": "LORA", "r": 1, "target_modules": targets}, save(tensors))
            result = {"error": None}
        except InvalidAdapter as e:
            result = {"error": str(e)}
    """)
    assert "target_modules names 'm0.layers.0.proj' but the file has no LoRA tensors" in got["error"]


def test_many_listed_names_select_exactly_their_modules():
    paths = [f"model.layers.{i}.{p}" for i in range(300) for p in ("q", "k", "v")]
    targets = ["q", *(f"layers.{i}.k" for i in range(0, 300, 2)), *(f"model.layers.{i}.v" for i in range(150))]
    chosen = [p for p in paths if p.endswith(".q") or (p.endswith(".k") and int(p.split(".")[2]) % 2 == 0)
              or (p.endswith(".v") and int(p.split(".")[2]) < 150)]
    adapter = _load(_config(target_modules=targets), chosen)
    assert sorted(m.name for m in adapter.modules) == sorted(chosen)
    with pytest.raises(InvalidAdapter, match=r"model\.layers\.1\.k.*do not select it"):
        _load(_config(target_modules=targets), [*chosen, "model.layers.1.k"])


# ---------------------------------------------------------------- equivalence with PEFT (kept exact)


def test_parse_key_agrees_with_the_old_regex_on_valid_paths():
    old = re.compile(
        r"(?:base_model\.model\.)?(?P<path>.+?)(?P<wrap>(?:\.base_layer)*)\.(?P<part>lora_A|lora_B)\.weight"
    )
    keys = [
        "base_model.model.model.layers.0.q.lora_A.weight",
        "model.layers.0.q.lora_B.weight",
        "base_model.model.m.experts.base_layer.base_layer.lora_A.weight",
        "base_layer.base_layer.lora_B.weight",
        "base_model.model.base_layer.lora_A.weight",
        "base_model.model.base_model.model.x.lora_A.weight",
        "base_model.x.lora_A.weight",
        "a.base_layer.lora_A.weight",
    ]
    for key in keys:
        m = old.fullmatch(key)
        k = parse_key(key)
        assert (k.path, k.depth, k.part) == (m["path"], m["wrap"].count(".base_layer"), m["part"]), key


_TOKENS = ["a", "q", "_", "0", "1", ".", "\\.", "*", "+", "?", "*?", "{2}", "{1,3}", "|", "(", ")", "(?:",
           "[", "]", "[^", "-", "^", "$", "\\d", "\\w", "\\b", "(?i)", "A", "proj", "layers", "q_proj",
           "self_attn", "mlp", "up_proj", ".*", "\\d+", "{", "}", ","]
_KEYS = [f"model.layers.{i}.{p}" for i in (0, 1, 12) for p in
         ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj", "mlp.experts.gate_up_proj", "a_q")] + [
    "q_proj", "lm_head", "A.b", "model.layers.x.q_proj"]


def _random_patterns(seed: int, n: int) -> list[str]:
    rnd = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        p = "".join(rnd.choice(_TOKENS) for _ in range(rnd.randint(1, 6)))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                re.compile(rf"(.*\.)?({p})$")
                re.compile(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.")
        except re.error:
            continue
        out.append(p)
    return out


def test_pattern_key_agrees_with_peft_on_random_patterns():
    from peft.utils.other import get_pattern_key

    patterns = _random_patterns(1, 3000)
    compared = 0
    for i in range(0, len(patterns), 6):
        group = dict.fromkeys([*patterns[i : i + 6], "q_proj", r"layers\.1\..*", "layers.0.mlp.up_proj"], 1)
        try:
            parse_config(_config(target_modules=["q_proj"], rank_pattern=group))
        except InvalidAdapter:
            continue  # refused (re2 lacks it, or re and re2 read it differently): never matched
        for key in _KEYS:
            assert pattern_key(group, key) == get_pattern_key(group.keys(), key), (group, key)
        compared += 1
    assert compared > 300


def test_dotted_and_literal_keys_agree_with_peft():
    # dotted names are looked up, not run as regexes: their '.' still matches any character
    from peft.utils.other import get_pattern_key

    group = {"layers.1": 1, "a.b": 2, r"x\.q_proj": 3, "q.proj": 4, ".": 5, "layers.1.q": 6, "1.q": 7, "q_proj": 8}
    keys = ["model.layers_1", "model.layersa1", "aab", "a.b", "m.aXb", "xxq_proj", "m.x.q_proj", "q_proj", "qqproj",
            "model.layers.1.q", "model.layers11q", "z.layersZ1Zq", "a", "model.layers.1.q_proj"]
    for key in keys:
        assert pattern_key(group, key) == get_pattern_key(group.keys(), key), key
        reordered = dict(reversed(group.items()))
        assert pattern_key(reordered, key) == get_pattern_key(reordered.keys(), key), key


def test_regex_steps_are_budgeted_not_only_matches():
    """A match costs RE2 about len(path) x program size steps: few matches of big patterns over a
    long module path are refused by their steps, before they run, not after minutes of them."""
    from mint_store.peft.patterns import Budget, PatternTable

    keys = [f"(?:[ab.]*b){{300}}x{i}" for i in range(1024)]  # each compiles to ~900 instructions
    path = ".".join(["ab" * 64] * 31) + ".q_proj"  # a valid module path of ~4,000 characters
    budget = Budget(work=50_000_000)
    table = PatternTable(keys, "rank_pattern", budget)
    with pytest.raises(LimitExceeded, match="regex steps"):
        table.first(path)
    assert budget.limit - budget.left < 20  # refused after a dozen matches, not 1,024
    assert PatternTable(keys, "rank_pattern", Budget(work=50_000_000)).first("model.q_proj") is None  # short paths pass


def test_pattern_work_is_budgeted():
    from mint_store.peft.patterns import Budget, PatternTable

    table = PatternTable([f"l{i}+" for i in range(50)], "rank_pattern", Budget(120))
    assert table.first("model.l7") == "l7+"  # 8 matches spent
    with pytest.raises(LimitExceeded, match="regular-expression matches"):
        for i in range(10):
            table.first(f"model.x{i}")  # 50 each: the budget runs out


def test_module_targeting_agrees_with_peft_on_random_patterns():
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    compared = 0
    for p in _random_patterns(2, 1500):
        for fields in (
            {"target_modules": p},
            {"target_modules": ["q_proj", "up_proj"], "exclude_modules": p},
            {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": [0, 12], "layers_pattern": [p, "layers"]},
        ):
            try:
                _, settings = parse_config(_config(**fields))
            except InvalidAdapter:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                peft_config = LoraConfig(r=2, lora_alpha=4, **fields)
            for key in _KEYS:
                want = bool(check_target_module_exists(peft_config, key))
                assert module_targeted(settings, key) == want, (fields, key)
            compared += 1
    assert compared > 1000


# ---------------------------------------------------------------- item 4: numbers


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lora_alpha": 1e39}, "lora_alpha must be a finite number within float32 range"),
        ({"alpha_pattern": {"q": 1e39}}, "alpha_pattern\\['q'\\] must be a finite number within float32"),
        ({"lora_alpha": -1e39}, "lora_alpha must be a finite number within float32 range"),
        ({"lora_alpha": 10**400}, "integer of 401 digits is too large"),
        ({"r": 10**30}, "r must be a positive integer rank \\(1\\.\\.16777216\\)"),
        ({"rank_pattern": {"q": 2**40}}, "rank_pattern\\['q'\\] must be a positive integer rank"),
        ({"layers_to_transform": [-1]}, "layers_to_transform must be a layer index"),
        ({"layers_to_transform": 2**40}, "layers_to_transform must be a layer index"),
    ],
)
def test_numeric_fields_out_of_range_are_invalid_adapter(fields, message):
    with pytest.raises(InvalidAdapter, match=message):
        _load(_config(target_modules=["q"]) | fields, ["model.layers.0.q"])


def test_alpha_overflowing_float32_is_invalid_adapter_not_stop_iteration():
    # in a coroutine the old StopIteration hung the request: here it must be the typed error
    with pytest.raises(InvalidAdapter):
        _load(_config(target_modules=["q"], lora_alpha=1e39), ["model.layers.0.q"])


# ---------------------------------------------------------------- item 9: JSON and headers


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"peft_type": "LORA", "target_modules": ["q"], "r": 2, "lora_alpha": ' + b"9" * 5000 + b"}",
         "integer of 5000 digits"),
        (b'{"peft_type": "LORA", "target_modules": ["q"], "r": 2, "lora_dropout": NaN}', "NaN is not valid JSON"),
        (b'{"peft_type": "LORA", "target_modules": ["q"], "r": 2, "lora_dropout": 1e400}', "out of range"),
        (b'{"peft_type": "LORA", "target_modules": ["q"], "runtime_config": ' + b"[" * 100 + b"]" * 100 + b"}",
         "nests more than 32 levels"),
    ],
    ids=["4300-digit int", "NaN", "overflowing float", "deep nesting"],
)
def test_config_json_that_python_accepts_but_is_hostile_is_refused(raw, message):
    with pytest.raises(InvalidAdapter, match=message):
        _load(raw, ["model.layers.0.q"])


def _raw_file(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (_raw_file(b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + b"4" * 5000 + b"]}}"),
         "integer of 5000 digits"),
        (_raw_file({"x": {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}}), "is too large"),
        (_raw_file({"x": {"dtype": "F32", "shape": [0, 2**35, 2**35], "data_offsets": [0, 0]}}), "is too large"),
    ],
    ids=["4300-digit offset", "zero dim and 2**70", "zero dim and huge product"],
)
def test_hostile_safetensors_headers_are_invalid_adapter(weights, message):
    with pytest.raises(InvalidAdapter, match=message):
        load_peft_files(_config(target_modules=["q"]), weights)
