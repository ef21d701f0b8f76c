"""``GET .../peft``: the two PEFT files as a tar, streamed, with an exact ``Content-Length``.

Nothing is built whole in memory: the adapter is loaded (one row) and turned into PEFT's
state dict (checked like ``peft_files``), then the tar headers, the config, the
safetensors header and each tensor's bytes go out chunk by chunk. The bytes equal what
``mint pull`` writes (``safetensors.torch.save`` of the same state dict: tensors ordered by
dtype, largest first, then by name; the JSON header compact and padded with spaces to a
multiple of 8), so the size is known before the first byte is sent.
"""

from __future__ import annotations

import json
import struct
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from ...peft.directory import peft_export
from ..deadlines import deadline_paused, send_within
from .uploads import CONFIG_PART, WEIGHTS_PART

CHUNK = 1 * 2**20
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE
# safetensors' dtype names, in the order of its Rust enum (which sorts the file: descending)
_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
           torch.float16: "F16", torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32",
           torch.float64: "F64", torch.int64: "I64"}
_RANK = {name: i for i, name in enumerate(_DTYPES.values())}


@dataclass(frozen=True, slots=True)
class PeftExport:
    """What the tar holds: the config bytes, the safetensors header and tensors in file order."""

    config: bytes
    st_header: bytes
    tensors: tuple[torch.Tensor, ...]
    st_size: int

    def tar_size(self) -> int:
        return -(-self._body_size() // _RECORD) * _RECORD  # tarfile pads the archive to a whole record

    def _body_size(self) -> int:
        """The members (headers, data padded to blocks) and the two closing blocks."""
        members = ((CONFIG_PART, len(self.config)), (WEIGHTS_PART, self.st_size))
        return sum(len(_member(name, n, 0)) + _padded(n) for name, n in members) + 2 * _BLOCK


def _padded(n: int) -> int:
    return -(-n // _BLOCK) * _BLOCK


def safetensors_layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[bytes, list[torch.Tensor]]:
    """The header (length prefix included) and tensor order of ``safetensors.torch.save``."""
    order = sorted(tensors, key=lambda k: (-_RANK[_DTYPES[tensors[k].dtype]], k))
    doc: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for k in order:
        t = tensors[k]
        n = t.numel() * t.element_size()
        doc[k] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, [tensors[k] for k in order]


def build_export(store: Any, ref: str) -> PeftExport:
    """Load ``ref`` and lay out its PEFT files (blocking: runs on the executor)."""
    config, tensors = peft_export(store.load(ref))
    header, ordered = safetensors_layout(tensors, {"format": "pt"})
    size = len(header) + sum(t.numel() * t.element_size() for t in ordered)
    return PeftExport(config, header, tuple(t.contiguous() for t in ordered), size)


def _member(name: str, size: int, mtime: int) -> bytes:
    """The member's header: one block, or three from 8 GiB up (a pax header holds the size)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = mtime
    return info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")


def _tensor_bytes(t: torch.Tensor) -> Iterator[memoryview]:
    if t.numel() == 0:
        return
    view = memoryview(t.reshape(-1).view(torch.uint8).numpy().data)  # no copy: the tensor's own bytes
    for i in range(0, len(view), CHUNK):
        yield view[i : i + CHUNK]


def tar_chunks(export: PeftExport, mtime: int | None = None) -> Iterator[bytes | memoryview]:
    """The tar, piece by piece (``tarfile``'s own headers; data padded to 512-byte blocks)."""
    mtime = int(time.time()) if mtime is None else mtime
    yield _member(CONFIG_PART, len(export.config), mtime)
    yield export.config + b"\0" * (_padded(len(export.config)) - len(export.config))
    yield _member(WEIGHTS_PART, export.st_size, mtime)
    yield export.st_header
    for t in export.tensors:
        yield from _tensor_bytes(t)
    end = _padded(export.st_size) - export.st_size + 2 * _BLOCK
    yield b"\0" * (end + export.tar_size() - export._body_size())


async def send_tar(request: web.Request, export: PeftExport, filename: str, read_timeout: float) -> web.StreamResponse:
    """Stream the tar; a client that stops reading for ``read_timeout`` is cut off."""
    resp = web.StreamResponse(headers={"Content-Type": "application/x-tar",
                                       "Content-Disposition": f'attachment; filename="{filename}"'})
    resp.content_length = export.tar_size()
    await resp.prepare(request)
    with deadline_paused(request, None):  # a slow reader is not the server's work
        for chunk in tar_chunks(export):
            await send_within(request, resp.write(chunk), read_timeout)
    await resp.write_eof()
    return resp
