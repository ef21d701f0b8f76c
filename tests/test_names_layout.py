"""Names, refs, layouts and rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mint_store.errors import InvalidAdapter, InvalidName, LimitExceeded
from mint_store.format.adapter import Adapter, make_adapter
from mint_store.format.layout import ALIGN, Layout, check_finite_rows, decode_row, encode_rows
from mint_store.format.names import Ref, check_name, parse_ref
from tests.support.factories import random_adapter

NAME = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,20}", fullmatch=True)


@given(NAME, NAME, st.integers(1, 10**9), NAME)
def test_refs_round_trip(tenant: str, name: str, version: int, tag: str) -> None:
    assert parse_ref(f"{tenant}/{name}") == Ref(tenant, name)
    assert parse_ref(f"{tenant}/{name}@{version}") == Ref(tenant, name, version=version)
    assert parse_ref(f"{tenant}/{name}:{tag}") == Ref(tenant, name, tag=tag)
    for text in (f"{tenant}/{name}", f"{tenant}/{name}@{version}", f"{tenant}/{name}:{tag}"):
        assert str(parse_ref(text)) == text


@given(st.text(max_size=80))
def test_names_outside_the_grammar_are_refused(text: str) -> None:
    import re

    ok = re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,63}", text) is not None and ".." not in text
    if ok:
        assert check_name(text) == text
    else:
        with pytest.raises(InvalidName):
            check_name(text)


@pytest.mark.parametrize(
    "ref",
    ["", "acme", "acme/", "/x", "acme/x@0", "acme/x@-1", "acme/x@1.5", "acme/x@", "acme/x:", "acme/..",
     "acme/x/y", "sha:xyz", "sha:" + "A" * 32, "ａcme/x", "acme/x@１", "acme/x:Prod"],
)
def test_bad_refs(ref: str) -> None:
    with pytest.raises(InvalidName):
        parse_ref(ref)


def test_layout_is_aligned_and_canonical() -> None:
    a = random_adapter(1, rank=3, dtype=torch.bfloat16)
    layout = a.layout
    assert all(t.offset % ALIGN == 0 for t in layout.tensors)
    assert layout.tensors[-1].name == "scaling" and layout.tensors[-1].shape == (len(a.modules),)
    assert Layout.from_dict(layout.to_dict()) == layout
    assert Layout.from_dict(layout.to_dict()).layout_id == layout.layout_id
    # canonical: module order does not depend on insertion order
    mods = {m.name: (m.a, m.b, m.scaling) for m in reversed(a.modules)}
    assert make_adapter(mods, base="tiny").layout.layout_id == layout.layout_id
    names = [m.name for m in a.modules]
    assert names.index("model.layers.1.self_attn.q_proj") > names.index("model.layers.0.self_attn.v_proj")
    # names whose numbers tie (a leading zero): still one order, so one content id
    g = torch.Generator().manual_seed(2)
    pair = {n: (torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g), 1.0) for n in ("m.1", "m.01")}
    ids = {make_adapter(dict(order), base="tiny").content_id() for order in (pair.items(), reversed(pair.items()))}
    assert len(ids) == 1


def test_decoded_tensors_are_views_of_the_row() -> None:
    a = random_adapter(2)
    layout, row = a.to_row()
    tensors = decode_row(layout, row)
    first = layout.modules[0]
    row[first.a.offset : first.a.offset + 4] = np.frombuffer(np.float32(7.5).tobytes(), np.uint8)
    assert tensors[first.a.name].reshape(-1)[0].item() == 7.5  # no copy was made
    back = Adapter.from_row(layout, row)
    assert back.modules[0].a.data_ptr() == tensors[first.a.name].data_ptr()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.integers(0, 10**6),
       st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_bitwise_finite_check_agrees_with_torch(dtype: torch.dtype, pos: int, bad: float) -> None:
    a = random_adapter(3, dtype=dtype)
    layout = a.layout
    n = 3
    stacked = {k: torch.stack([v] * n) for k, v in a.state_dict().items()}
    names = [t.name for t in layout.tensors]
    victim = names[pos % len(names)]
    flat = stacked[victim][1].reshape(-1)
    flat[pos % flat.numel()] = bad
    rows = encode_rows(layout, stacked, n)
    assert check_finite_rows(layout, rows).tolist() == [True, False, True]


def test_invalid_tensors_are_refused() -> None:
    r = torch.randn
    cases = [
        ({"m.x": (r(2, 8), r(4, 3), 1.0)}, "different LoRA ranks"),
        ({"m.x": (r(2, 8), r(4, 2, 1), 1.0)}, "incompatible"),
        ({"m.x": (r(3, 2, 8), r(4, 4, 2), 1.0)}, "experts"),
        ({"m.x": (r(2, 8).double(), r(4, 2).double(), 1.0)}, "unsupported dtype"),
        ({"m.x": (r(2, 8), r(4, 2).bfloat16(), 1.0)}, "lora_A is torch.float32 and lora_B torch.bfloat16"),
        ({"m.x": (r(2, 8), r(4, 2), float("nan"))}, "scaling"),
        ({"m.x": (torch.full((2, 8), float("inf")), r(4, 2), 1.0)}, "NaN or Inf"),
        ({"m..x": (r(2, 8), r(4, 2), 1.0)}, "invalid module name"),
        ({}, "no LoRA modules"),
    ]
    for mods, msg in cases:
        with pytest.raises(InvalidAdapter, match=msg):
            make_adapter(mods)
    from mint_store.format.adapter import AdapterLimits

    with pytest.raises(LimitExceeded):
        make_adapter({"m.x": (r(2, 8), r(4, 2), 1.0)}, limits=AdapterLimits(max_row_bytes=64))
