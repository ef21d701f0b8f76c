"""The safetensors parser refuses every malformed file with InvalidAdapter, before loading."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from mint_store.errors import InvalidAdapter, LimitExceeded, UnsupportedAdapter
from mint_store.peft.safetensors_check import (
    ALLOWED_DTYPES,
    MAX_HEADER_BYTES,
    read_safetensors,
    read_safetensors_with_header,
)


def _valid() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "m.lora_A": torch.randn(4, 6, generator=g),
        "m.lora_B": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "n.lora_A": torch.randn(2, 3, 2, generator=g).to(torch.float16),
    }


def _raw(header: dict, data: bytes = b"", *, pad_to: int = 8) -> bytes:
    """A file with exactly this header (as the reference writer lays it out) and data."""
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % pad_to)
    return struct.pack("<Q", len(h)) + h + data


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_reads_library_output_from_bytes_and_path(tmp_path):
    tensors = _valid()
    blob = save(tensors, metadata={"format": "pt"})
    header, got = read_safetensors_with_header(blob)
    assert header.metadata == {"format": "pt"}
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)
    p = tmp_path / "x.safetensors"
    p.write_bytes(blob)
    from_path = read_safetensors(p)
    assert all(torch.equal(from_path[k], t) for k, t in tensors.items())
    # owned copies: mutating the source buffer must not change them
    buf = bytearray(blob)
    got2 = read_safetensors(buf)
    buf[-8:] = b"\xff" * 8
    assert torch.equal(got2["n.lora_A"], tensors["n.lora_A"])


def test_zero_size_tensor_and_empty_file_are_well_formed():
    assert read_safetensors(_raw({})) == {}
    got = read_safetensors(_raw({"z": _entry("F32", [0, 3], 0, 0)}))
    assert got["z"].shape == (0, 3)


@pytest.mark.parametrize("size", [0, 1, 7])
def test_shorter_than_8_bytes(size):
    with pytest.raises(InvalidAdapter, match="shorter than the 8-byte header length"):
        read_safetensors(b"\x01" * size)


def test_truncated_file(tmp_path):
    blob = save(_valid())
    with pytest.raises(InvalidAdapter, match=r"run past the data section|truncated"):
        read_safetensors(blob[:-3])
    p = tmp_path / "t.safetensors"
    p.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(InvalidAdapter):
        read_safetensors(p)


def test_header_length_larger_than_file():
    with pytest.raises(InvalidAdapter, match="claims 1000 bytes but the file has only 2"):
        read_safetensors(struct.pack("<Q", 1000) + b"{}")


def test_header_over_100mb_refused_from_length_field_alone():
    # only the 8-byte length is crafted: nothing near 100 MB is allocated or read
    n = MAX_HEADER_BYTES + 1
    with pytest.raises(LimitExceeded, match=f"claims {n} bytes, over the limit"):
        read_safetensors(struct.pack("<Q", n) + b"{}")
    with pytest.raises(LimitExceeded):
        read_safetensors(struct.pack("<Q", 2**64 - 1) + b"{}")


def test_tensor_count_is_bounded_before_the_header_is_parsed(monkeypatch):
    """Each entry costs ~1 KiB and tens of microseconds parsed: a 100 MiB header holds ~1.8
    million. Past max_tensors the header is refused from a byte count, never parsed."""
    import mint_store.peft.safetensors_check as sc

    header = {f"t{i}": _entry("F32", [0], 0, 0) for i in range(1000)}
    raw = _raw(header)
    assert len(read_safetensors(raw, max_tensors=1000)) == 1000

    def never(*args, **kwargs):
        raise AssertionError("parsed")

    with pytest.raises(LimitExceeded, match="more than 999 tensors"):  # keys spelled with a JSON escape
        text = json.dumps(header, separators=(",", ":")).replace('"data_offsets"', '"data_\\u006fffsets"').encode()
        read_safetensors(struct.pack("<Q", len(text)) + text, max_tensors=999)
    monkeypatch.setattr(sc, "_parse_json", never)
    with pytest.raises(LimitExceeded, match="lists 1000 tensors, over the limit of 999"):
        read_safetensors(raw, max_tensors=999)


def test_a_peft_file_with_more_tensors_than_its_modules_allow_is_refused(tmp_path):
    from mint_store.format.adapter import AdapterLimits
    from mint_store.peft.directory import load_peft_files

    tensors = {f"base_model.model.l{i}.q_proj.lora_A.weight": torch.zeros(1, 4) for i in range(30)}
    config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"]}
    with pytest.raises(LimitExceeded, match="lists 30 tensors, over the limit of 28"):
        load_peft_files(config, save(tensors), limits=AdapterLimits(max_modules=3))


def test_file_over_limit(tmp_path):
    p = tmp_path / "big.safetensors"
    p.write_bytes(save(_valid()))
    with pytest.raises(LimitExceeded, match="over the limit of 10"):
        read_safetensors(p, max_file_bytes=10)


def test_garbage():
    with pytest.raises(InvalidAdapter):
        read_safetensors(bytes(range(256)) * 4)
    with pytest.raises(InvalidAdapter, match="not valid JSON"):
        read_safetensors(struct.pack("<Q", 6) + b"{nope}")


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"[1, 2]  ", "must be a JSON object"),
        (b'"text"  ', "must be a JSON object"),
        (b' {}     ', "starting with '{'"),
        (b'{"\xff": 1}', "not valid UTF-8"),
        (b'{"a": NaN}', "NaN"),
        (b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, "a": 1}', "twice"),
        (b"[" * 5000 + b"]" * 5000, "JSON object"),
        (b"{" + b'"a":{' * 3000 + b"}" * 3001, "nests too deeply|not valid JSON"),
    ],
)
def test_bad_header_json(header, message):
    with pytest.raises(InvalidAdapter, match=message):
        read_safetensors(struct.pack("<Q", len(header)) + header + b"\0" * 4)


@pytest.mark.parametrize("dtype", ["F64", "I32", "I64", "U8", "BOOL", "F8_E4M3"])
def test_unsupported_dtype(dtype):
    with pytest.raises(UnsupportedAdapter, match=f"unsupported dtype {dtype}; adapters must be F32, BF16 or F16"):
        read_safetensors(_raw({"x": _entry(dtype, [1], 0, 8)}, b"\0" * 8))


def test_unknown_dtype_is_invalid_not_unsupported():
    with pytest.raises(InvalidAdapter, match="not a safetensors dtype") as e:
        read_safetensors(_raw({"x": _entry("F31", [1], 0, 4)}, b"\0" * 4))
    assert not isinstance(e.value, UnsupportedAdapter)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"x": _entry("F32", [2, 3], 0, 20)}, 20, "needs 24 bytes but data_offsets span 20"),
        ({"x": _entry("BF16", [2, 3], 0, 24)}, 24, "needs 12 bytes"),
        ({"x": _entry("F32", [2**40, 2**40], 0, 8)}, 8, "needs"),
        ({"x": _entry("F32", [2], 0, 8), "y": _entry("F32", [2], 8, 16)}, 12, "run past the data section"),
        ({"x": _entry("F32", [2], 0, 8), "y": _entry("F32", [2], 4, 12)}, 12, "overlap another tensor"),
        ({"x": _entry("F32", [2], 0, 8), "y": _entry("F32", [2], 0, 8)}, 16, "overlap another tensor"),
        ({"x": _entry("F32", [1], 4, 8)}, 8, "4 unclaimed bytes before it"),
        ({"x": _entry("F32", [1], 0, 4)}, 9, "5 trailing bytes"),
        ({"x": _entry("F32", [1], 8, 4)}, 8, "end 4 is before begin 8"),
        ({"x": _entry("F32", [-1], 0, 4)}, 4, "non-negative integers"),
        ({"x": _entry("F32", [1.0], 0, 4)}, 4, "non-negative integers"),
        ({"x": _entry("F32", [True], 0, 4)}, 4, "non-negative integers"),
        ({"x": _entry("F32", [1] * 9, 0, 4)}, 4, "at most 8"),
        ({"x": _entry("F32", [1], 0, "4")}, 4, "data_offsets must be"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}}, 4, "exactly dtype"),
        ({"x": [1, 2]}, 0, "exactly dtype"),
        ({"": _entry("F32", [1], 0, 4)}, 4, "empty name"),
        ({"__metadata__": {"a": 1}}, 0, "string values"),
        ({"__metadata__": [1]}, 0, "string values"),
    ],
)
def test_bad_tensor_table(header, data, message):
    with pytest.raises(InvalidAdapter, match=message):
        read_safetensors(_raw(header, b"\0" * data))


def test_bad_table_refused_from_a_path_too(tmp_path):
    p = tmp_path / "o.safetensors"
    p.write_bytes(_raw({"x": _entry("F32", [2], 0, 8), "y": _entry("F32", [2], 4, 12)}, b"\0" * 12))
    with pytest.raises(InvalidAdapter, match="overlap"):
        read_safetensors(p)


def test_missing_file(tmp_path):
    with pytest.raises(InvalidAdapter, match="cannot open safetensors file"):
        read_safetensors(tmp_path / "nope.safetensors")


def test_values_are_not_judged_here():
    # NaN/Inf are legal safetensors; make_adapter refuses them (see test_peft_format)
    got = read_safetensors(save({"x": torch.tensor([float("nan"), float("inf")])}))
    assert got["x"].isnan()[0] and got["x"].isinf()[1]


# ---------------------------------------------------------------- property


_BLOB = save(_valid(), metadata={"format": "pt"})


def _check_against_header(blob: bytes, header, tensors) -> None:
    """Every returned tensor is exactly what the (independently parsed) header describes."""
    n = int.from_bytes(blob[:8], "little")
    doc = json.loads(blob[8 : 8 + n])
    doc.pop("__metadata__", None)
    assert set(tensors) == set(doc)
    for name, spec in doc.items():
        t = tensors[name]
        assert t.dtype == ALLOWED_DTYPES[spec["dtype"]][0]
        assert list(t.shape) == spec["shape"]
        b, e = spec["data_offsets"]
        assert t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == blob[8 + n + b : 8 + n + e]
    assert header.data_start == 8 + n


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(["flip", "set", "cut", "insert", "delete"]), st.integers(0, 10_000),
                  st.integers(0, 255)),
        min_size=1,
        max_size=4,
    )
)
def test_mutations_never_crash_or_lie(edits):
    buf = bytearray(_BLOB)
    for op, pos, val in edits:
        i = pos % (len(buf) + 1)
        if op == "flip" and i < len(buf):
            buf[i] ^= 1 << (val % 8)
        elif op == "set" and i < len(buf):
            buf[i] = val
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = bytes([val])
        elif op == "delete" and i < len(buf):
            del buf[i]
    try:
        header, tensors = read_safetensors_with_header(bytes(buf))
    except InvalidAdapter:
        return
    _check_against_header(bytes(buf), header, tensors)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_crash(data):
    try:
        read_safetensors(data)
    except InvalidAdapter:
        pass
