"""Packs: one Zarr v3 array of rows per layout, written in whole new shards only.

``packs/<layout_id>/`` is a group whose attributes hold the layout table; its array
``rows`` is uint8 ``(N, S)``, uncompressed, sharded ``(R, S)`` so a full shard is about
64 MiB. Rows over 8 MiB use ``(1, C)`` column chunks in one-row shards, which keeps each
row contiguous inside its shard object (chunks are stored in row-major order there).

A commit only ever writes shards that did not exist: its rows start at a fresh shard
boundary. The array is resized *before* the shards are written, so after a crash the
next allocation (max of the index and the array shape) can never reuse a shard key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from .errors import IntegrityError
from .layout import Layout
from .storage import Storage

PACK_FORMAT = 1
SHARD_TARGET_BYTES = 64 * 2**20
# a shard's index is 16 bytes per row slot, written even for a partial shard: cap the
# slots so that a one-adapter commit does not write a megabyte of index
MAX_ROWS_PER_SHARD = 1024
BIG_ROW_BYTES = 8 * 2**20
COLUMN_CHUNK_BYTES = 4 * 2**20
_INDEX_EMPTY = 2**64 - 1


@dataclass(frozen=True, slots=True)
class PackGeometry:
    row_nbytes: int
    rows_per_shard: int
    chunk_cols: int  # bytes per inner chunk along the row

    @property
    def chunks_per_row(self) -> int:
        return -(-self.row_nbytes // self.chunk_cols)

    @property
    def shard_cols(self) -> int:
        return self.chunks_per_row * self.chunk_cols


def geometry_for(row_nbytes: int, *, shard_target_bytes: int = SHARD_TARGET_BYTES) -> PackGeometry:
    if row_nbytes > BIG_ROW_BYTES:
        return PackGeometry(row_nbytes, 1, COLUMN_CHUNK_BYTES)
    rows = max(1, min(MAX_ROWS_PER_SHARD, shard_target_bytes // row_nbytes))
    return PackGeometry(row_nbytes, rows, row_nbytes)


@dataclass(frozen=True, slots=True)
class RowPlacement:
    row: int
    shard_key: str
    offset: int
    length: int


def pack_prefix(layout_id: str) -> str:
    return f"packs/{layout_id}"


def shard_key(layout_id: str, shard: int) -> str:
    return f"packs/{layout_id}/rows/c/{shard}/0"


class Pack:
    """Writer-side handle on one layout's array."""

    def __init__(self, storage: Storage, layout: Layout, geometry: PackGeometry, array: Any) -> None:
        self.storage = storage
        self.layout = layout
        self.geometry = geometry
        self._array = array

    @classmethod
    def open_or_create(cls, storage: Storage, zstore: Any, layout: Layout, geometry: PackGeometry) -> Pack:
        path = pack_prefix(layout.layout_id)
        try:
            array = zarr.open_array(zstore, path=f"{path}/rows", mode="r+")
        except (FileNotFoundError, KeyError, zarr.errors.NodeNotFoundError):
            array = None
        if array is None:
            group = zarr.open_group(zstore, path=path, mode="a")
            group.attrs.update(
                {"mint_pack_format": PACK_FORMAT, "layout": layout.to_dict(), "layout_id": layout.layout_id}
            )
            g = geometry
            array = group.create_array(
                "rows",
                shape=(0, g.row_nbytes),
                chunks=(1, g.chunk_cols),
                shards=(g.rows_per_shard, g.shard_cols),
                dtype="uint8",
                compressors=None,
                filters=None,
                fill_value=0,
                config={"write_empty_chunks": True},
            )
            storage.make_durable([f"{path}/zarr.json", f"{path}/rows/zarr.json"])
        return cls(storage, layout, geometry, array)

    @property
    def nrows(self) -> int:
        return int(self._array.shape[0])

    def next_free_row(self, index_next_row: int) -> int:
        r = self.geometry.rows_per_shard
        start = max(index_next_row, self.nrows)
        return -(-start // r) * r

    def write_rows(
        self, start: int, rows: np.ndarray, *, crash: Callable[[str], None] | None = None
    ) -> list[RowPlacement]:
        """Write ``rows`` ([k, S] uint8) at ``start`` (a shard boundary) as new shards."""
        g = self.geometry
        k = rows.shape[0]
        if start % g.rows_per_shard:
            raise ValueError("rows must start at a shard boundary")
        self._array.resize((start + k, g.row_nbytes))
        self.storage.make_durable([f"{pack_prefix(self.layout.layout_id)}/rows/zarr.json"])
        if crash is not None:
            crash("after_resize")
        self._array[start : start + k] = rows
        first, last = start // g.rows_per_shard, (start + k - 1) // g.rows_per_shard
        keys = [shard_key(self.layout.layout_id, s) for s in range(first, last + 1)]
        self.storage.make_durable(keys)
        out: list[RowPlacement] = []
        for s, key in zip(range(first, last + 1), keys, strict=True):
            offsets = self.row_offsets(key)
            for lr in range(g.rows_per_shard):
                row = s * g.rows_per_shard + lr
                if start <= row < start + k:
                    out.append(RowPlacement(row, key, offsets[lr], g.row_nbytes))
        return out

    def row_offsets(self, key: str) -> list[int]:
        """Byte offset of each row inside a shard, from the shard's own index."""
        g = self.geometry
        nchunks = g.rows_per_shard * g.chunks_per_row
        index_nbytes = nchunks * 16 + 4  # (offset, nbytes) uint64 pairs + crc32c
        size = self.storage.size(key)
        tail = self.storage.read_range(key, size - index_nbytes, index_nbytes)
        entries = np.frombuffer(tail[:-4], dtype="<u8").reshape(g.rows_per_shard, g.chunks_per_row, 2)
        out: list[int] = []
        for lr in range(g.rows_per_shard):
            first = int(entries[lr, 0, 0])
            if first == _INDEX_EMPTY:
                out.append(-1)
                continue
            # the row must be one contiguous run so that reading it is one call
            for c in range(g.chunks_per_row):
                if int(entries[lr, c, 0]) != first + c * g.chunk_cols or int(entries[lr, c, 1]) != g.chunk_cols:
                    raise IntegrityError(f"shard {key}: row {lr} is not contiguous; refusing to index it")
            out.append(first)
        return out

    def read_row_zarr(self, row: int) -> np.ndarray:
        return np.asarray(self._array[row])


def read_row_with_zarr(zstore: Any, layout_id: str, row: int) -> np.ndarray:
    """Zarr's own read path for one row (cross-checks the offset-based reads)."""
    array = zarr.open_array(zstore, path=f"{pack_prefix(layout_id)}/rows", mode="r")
    return np.asarray(array[row])
