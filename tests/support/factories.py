"""Adapters made from tensors for store tests (no transformers needed)."""

from __future__ import annotations

import torch

from mint_store.format.adapter import Adapter, make_adapter

HIDDEN = 32
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def random_adapter(
    seed: int,
    *,
    rank: int = 2,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    base: str = "tiny",
    hidden: int = HIDDEN,
    experts: int | None = None,
) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    mods = {}
    for layer in range(layers):
        for m in MODULES:
            a = torch.randn(rank, hidden, generator=g).to(dtype)
            b = torch.randn(hidden, rank, generator=g).to(dtype)
            mods[f"model.layers.{layer}.self_attn.{m}"] = (a, b, 2.0 / rank)
        if experts:
            a = torch.randn(experts, rank, hidden, generator=g).to(dtype)
            b = torch.randn(experts, 2 * hidden, rank, generator=g).to(dtype)
            mods[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = (a, b, 1.0)
    return make_adapter(mods, base=base)


def corrupt_byte(storage, key: str, offset: int) -> None:
    """Flip one stored byte: in place on disk (bit rot), or by overwriting the S3 object."""
    path = storage.local_path(key)
    if path is not None:
        with open(path, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]))
        return
    data = bytearray(storage.get(key))
    data[offset] ^= 0xFF
    storage.put(key, bytes(data))
