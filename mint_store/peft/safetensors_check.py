"""Untrusted safetensors: check the whole header before a single tensor byte is read.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of UTF-8 JSON + a data section.
The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data section) plus an optional ``__metadata__`` string map.

We are as strict as the format's reference implementation and a little stricter: the
tensors must tile the data section exactly (no gaps, no overlaps, no trailing bytes),
names may not repeat, and only the dtypes an adapter row can hold are accepted. Tensors
are then copied out of the checked byte ranges, so what is returned always agrees with
the header that was checked.
"""

from __future__ import annotations

import io
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ..errors import InvalidAdapter, LimitExceeded, UnsupportedAdapter
from ..format import strict_json
from .patterns import MAX_TENSOR_NAME_CHARS

MAX_HEADER_BYTES = 100 * 2**20
MAX_FILE_BYTES = 64 * 2**30
MAX_DIMS = 8
MAX_DIM = 2**40  # one dimension; with a zero elsewhere a shape holds no bytes, so bound each
MAX_ELEMENTS = 2**48  # product of the non-zero dimensions: torch.empty must not overflow
METADATA_KEY = "__metadata__"

# safetensors dtype -> (torch dtype, bytes per element)
ALLOWED_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
}
# the rest of the format's vocabulary: well-formed, but not something an adapter row holds
_OTHER_DTYPES = frozenset(
    {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F64", "F8_E4M3", "F8_E5M2",
     "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"}
)
_HEADER_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a checked header; ``begin``/``end`` are relative to the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return ALLOWED_DTYPES[self.dtype][0]


@dataclass(frozen=True, slots=True)
class SafetensorsHeader:
    """A header that passed every check. ``tensors`` are in data-section order."""

    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the data section
    file_size: int


def check_header(
    prefix: bytes,
    *,
    file_size: int,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_tensors: int | None = None,
) -> SafetensorsHeader:
    """Validate a header given the first ``8 + N`` bytes of a file of ``file_size`` bytes.

    Call :func:`header_length` first to learn how many bytes ``prefix`` must hold.
    """
    n = header_length(prefix[:8], file_size=file_size, max_header_bytes=max_header_bytes,
                      max_file_bytes=max_file_bytes)
    if len(prefix) < 8 + n:
        raise InvalidAdapter(f"safetensors header is cut short: {len(prefix) - 8} of {n} bytes present")
    raw = prefix[8 : 8 + n]
    # counted before parsing: each entry costs ~1 KiB and ~40 us parsed and checked, and a 100 MiB
    # header can hold 1.8 million of them (a JSON string holds no bare quote: this counts keys,
    # and a metadata value spelled "data_offsets", never fewer than the entries)
    if max_tensors is not None and (count := raw.count(b'"data_offsets"')) > max_tensors:
        raise LimitExceeded(f"safetensors header lists {count} tensors, over the limit of {max_tensors}")
    doc = _parse_json(raw, max_tensors)
    metadata = _check_metadata(doc.pop(METADATA_KEY, None))
    entries = [_check_entry(name, spec) for name, spec in doc.items()]
    data_size = file_size - 8 - n
    _check_tiling(entries, data_size)
    entries.sort(key=lambda e: (e.begin, e.end))
    return SafetensorsHeader(tuple(entries), metadata, 8 + n, file_size)


def header_length(
    first8: bytes,
    *,
    file_size: int,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> int:
    """The header length N from the first 8 bytes, refused unless it fits the file and the limits."""
    if file_size > max_file_bytes:
        raise LimitExceeded(
            f"safetensors file is {file_size} bytes, over the limit of {max_file_bytes}; "
            "split the adapter or raise the limit"
        )
    if file_size < 8 or len(first8) < 8:
        raise InvalidAdapter(
            f"not a safetensors file: {file_size} bytes, shorter than the 8-byte header length; "
            "was the upload truncated?"
        )
    n = int.from_bytes(first8[:8], "little")
    if n > max_header_bytes:
        raise LimitExceeded(
            f"safetensors header claims {n} bytes, over the limit of {max_header_bytes}; "
            "this is not a sane adapter file"
        )
    if n > file_size - 8:
        raise InvalidAdapter(
            f"safetensors header claims {n} bytes but the file has only {file_size - 8} after the "
            "length field; the file is truncated or not safetensors"
        )
    if n < 2:
        raise InvalidAdapter(f"safetensors header of {n} bytes cannot hold a JSON object")
    return n


def read_safetensors(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview,
    *,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_tensors: int | None = None,
) -> dict[str, torch.Tensor]:
    """Check a safetensors file (path or bytes) and return its tensors (owned copies).

    Raises InvalidAdapter (or its subclasses LimitExceeded / UnsupportedAdapter) for anything
    malformed; never any other exception for bad content.
    """
    return read_safetensors_with_header(
        source, max_header_bytes=max_header_bytes, max_file_bytes=max_file_bytes, max_tensors=max_tensors
    )[1]


def read_safetensors_with_header(
    source: str | os.PathLike[str] | bytes | bytearray | memoryview,
    *,
    max_header_bytes: int = MAX_HEADER_BYTES,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_tensors: int | None = None,
) -> tuple[SafetensorsHeader, dict[str, torch.Tensor]]:
    """Like :func:`read_safetensors`, also returning the checked header (metadata, order)."""
    _check_byte_order()
    limits = {"max_header_bytes": max_header_bytes, "max_file_bytes": max_file_bytes}
    if isinstance(source, bytes | bytearray | memoryview):
        buf = memoryview(source).cast("B")
        n = header_length(bytes(buf[:8]), file_size=len(buf), **limits)
        header = check_header(bytes(buf[: 8 + n]), file_size=len(buf), max_tensors=max_tensors, **limits)
        return header, {e.name: _copy_from_buffer(buf, header.data_start, e) for e in header.tensors}
    try:
        f = open(Path(source), "rb")  # noqa: SIM115 -- closed by the with-block below
    except OSError as e:
        raise InvalidAdapter(f"cannot open safetensors file {str(source)!r}: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        first8 = f.read(8)
        n = header_length(first8, file_size=size, **limits)
        header = check_header(first8 + f.read(n), file_size=size, max_tensors=max_tensors, **limits)
        return header, _copy_from_file(f, header)


def _check_byte_order() -> None:
    if sys.byteorder != "little":  # pragma: no cover -- no big-endian CI
        raise UnsupportedAdapter("reading safetensors on a big-endian host is not supported")


def _parse_json(raw: bytes, max_tensors: int | None = None) -> dict[str, Any]:
    if not raw.startswith(b"{"):
        raise InvalidAdapter("safetensors header must be a JSON object starting with '{'")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidAdapter(f"safetensors header is not valid UTF-8 (byte {e.start})") from None
    try:
        # every field is checked below, so only the parser's own recursion needs bounding
        # entries counted as they are parsed: the byte count before misses keys spelled with JSON
        # escapes ("data_\\u006fffsets"), decoded by now
        entries = [0]

        def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            if max_tensors is not None and any(k == "data_offsets" for k, _ in pairs):
                entries[0] += 1
                if entries[0] > max_tensors:
                    raise LimitExceeded(f"safetensors header lists more than {max_tensors} tensors")
            return _no_duplicates(pairs)

        doc = strict_json.loads(text, max_depth=None, object_pairs_hook=hook)
    except InvalidAdapter:
        raise
    except ValueError as e:  # JSONDecodeError, 4,300-digit integers, NaN, overflowing floats, nesting
        where = f" at byte {e.pos}" if hasattr(e, "pos") else ""
        raise InvalidAdapter(f"safetensors header is not valid JSON: {getattr(e, 'msg', e)}{where}") from None
    if not isinstance(doc, dict):
        raise InvalidAdapter("safetensors header must be a JSON object of tensor entries")
    return doc


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise InvalidAdapter(f"safetensors header names {k!r} twice; each key must be unique")
        out[k] = v
    return out


def _check_metadata(meta: Any) -> dict[str, str]:
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise InvalidAdapter("safetensors __metadata__ must be an object of string values")
    return dict(meta)


def _check_entry(name: str, spec: Any) -> TensorEntry:
    if not name:
        raise InvalidAdapter("safetensors header has a tensor with an empty name")
    if len(name) > MAX_TENSOR_NAME_CHARS:
        raise InvalidAdapter(
            f"tensor name of {len(name)} characters is over the limit of {MAX_TENSOR_NAME_CHARS}: "
            f"{name[:100]!r}...; module paths are at most 32 parts of 128 characters"
        )
    if not isinstance(spec, dict) or set(spec) != _HEADER_FIELDS:
        raise InvalidAdapter(
            f"tensor {name!r}: header entry must be an object with exactly dtype, shape and data_offsets"
        )
    dtype = spec["dtype"]
    if dtype not in ALLOWED_DTYPES:
        if dtype in _OTHER_DTYPES:
            raise UnsupportedAdapter(
                f"tensor {name!r}: unsupported dtype {dtype}; adapters must be F32, BF16 or F16 "
                "(convert the weights before uploading)"
            )
        raise InvalidAdapter(f"tensor {name!r}: unsupported dtype {dtype!r}, not a safetensors dtype")
    shape = spec["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_count(d) for d in shape):
        raise InvalidAdapter(
            f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} non-negative integers, "
            f"got {str(shape)[:200]}"
        )
    offsets = spec["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise InvalidAdapter(
            f"tensor {name!r}: data_offsets must be [begin, end] integers, got {str(offsets)[:200]}"
        )
    begin, end = offsets
    if end < begin:
        raise InvalidAdapter(f"tensor {name!r}: data_offsets end {end} is before begin {begin}")
    nbytes = math.prod(shape) * ALLOWED_DTYPES[dtype][1]
    if end - begin != nbytes:
        raise InvalidAdapter(
            f"tensor {name!r}: shape {shape} of {dtype} needs {nbytes} bytes but data_offsets span "
            f"{end - begin}"
        )
    # a zero dimension makes any other dimension "fit" in 0 bytes; torch.empty would overflow
    if any(d > MAX_DIM for d in shape) or math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise InvalidAdapter(
            f"tensor {name!r}: shape {shape} is too large (each dimension at most {MAX_DIM}, "
            f"at most {MAX_ELEMENTS} elements even where another dimension is 0)"
        )
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_tiling(entries: list[TensorEntry], data_size: int) -> None:
    """The tensors must cover ``[0, data_size)`` exactly once, like the reference reader demands."""
    pos = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.end > data_size:
            raise InvalidAdapter(
                f"tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] run past the data section of "
                f"{data_size} bytes; the file is truncated or its header is wrong"
            )
        if e.begin < pos:
            raise InvalidAdapter(
                f"tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] overlap another tensor"
            )
        if e.begin > pos:
            raise InvalidAdapter(
                f"tensor {e.name!r}: {e.begin - pos} unclaimed bytes before it in the data section; "
                "safetensors data must be contiguous"
            )
        pos = e.end
    if pos != data_size:
        raise InvalidAdapter(
            f"safetensors data section has {data_size - pos} trailing bytes that no tensor claims"
        )


def _empty_like(e: TensorEntry) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.empty(e.shape, dtype=e.torch_dtype)
    return t, t.reshape(-1).view(torch.uint8)


def _copy_from_buffer(buf: memoryview, data_start: int, e: TensorEntry) -> torch.Tensor:
    t, raw = _empty_like(e)
    if e.end > e.begin:
        src = buf[data_start + e.begin : data_start + e.end]
        raw.numpy()[:] = np.frombuffer(src, dtype=np.uint8)
    return t


def _copy_from_file(f: io.BufferedReader, header: SafetensorsHeader) -> dict[str, torch.Tensor]:
    # tensors tile the data section in order, so one sequential pass reads every byte once
    f.seek(header.data_start)
    out: dict[str, torch.Tensor] = {}
    for e in header.tensors:
        t, raw = _empty_like(e)
        view = memoryview(cast(Any, raw.numpy()))  # numpy's stubs do not declare the buffer protocol
        got = 0
        while got < len(view):
            k = f.readinto(view[got:])
            if not k:
                raise InvalidAdapter(f"tensor {e.name!r}: file ended early (was it modified while reading?)")
            got += k
        out[e.name] = t
    return out
