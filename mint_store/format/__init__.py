"""File formats: how adapters, rows, layouts, block digests, packs and storage keys are encoded.
Pure encodings with their checks; nothing here touches the index or the network.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .adapter import Adapter, AdapterLimits, LoraModule, make_adapter
    from .blocks import Block, Grid, RowBlocks, block_digest
    from .hashing import content_id
    from .keys import check_relative_key, shard_key
    from .layout import Layout, ModuleSpec, TensorSpec, build_layout, decode_row, encode_rows
    from .names import Ref, check_name, parse_ref
    from .packs import Pack, PackGeometry
    from .strict_json import loads

_EXPORTS = {
    "Adapter": ".adapter",
    "AdapterLimits": ".adapter",
    "Block": ".blocks",
    "Grid": ".blocks",
    "Layout": ".layout",
    "LoraModule": ".adapter",
    "ModuleSpec": ".layout",
    "Pack": ".packs",
    "PackGeometry": ".packs",
    "Ref": ".names",
    "RowBlocks": ".blocks",
    "TensorSpec": ".layout",
    "block_digest": ".blocks",
    "build_layout": ".layout",
    "check_name": ".names",
    "check_relative_key": ".keys",
    "content_id": ".hashing",
    "decode_row": ".layout",
    "encode_rows": ".layout",
    "loads": ".strict_json",
    "make_adapter": ".adapter",
    "parse_ref": ".names",
    "shard_key": ".keys",
}

__all__ = [
    "Adapter",
    "AdapterLimits",
    "Block",
    "Grid",
    "Layout",
    "LoraModule",
    "ModuleSpec",
    "Pack",
    "PackGeometry",
    "Ref",
    "RowBlocks",
    "TensorSpec",
    "block_digest",
    "build_layout",
    "check_name",
    "check_relative_key",
    "content_id",
    "decode_row",
    "encode_rows",
    "loads",
    "make_adapter",
    "parse_ref",
    "shard_key",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
