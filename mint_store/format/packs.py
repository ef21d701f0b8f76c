"""Packs: one Zarr v3 array of rows per layout, written in whole new shards only.

``packs/<layout_id>/`` is a group whose attributes hold the layout table; its array
``rows`` is uint8 ``(N, S)``, uncompressed, sharded ``(R, S)`` so a full shard is about
64 MiB. Rows over 8 MiB use ``(1, C)`` column chunks in one-row shards, which keeps each
row contiguous inside its shard object (chunks are stored in row-major order there).

Shard objects are encoded here (see :func:`encode_shard`) and written with one atomic put;
zarr owns the array metadata and reads them back like any shard it wrote itself.

A commit only ever writes shards that did not exist: its rows start at a fresh shard
boundary. The array is resized *before* the shards are written, so after a crash the
next allocation (max of the index and the array shape) can never reuse a shard key; and
shard objects are written create-only, so a key that exists anyway (another writer)
fails the commit instead of replacing rows that a committed version points at.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
import zarr

from ..errors import IntegrityError, ObjectExists, ShardTaken
from ..storage import Storage
from ..storage.retry import call_with_retry
from .keys import pack_prefix, shard_key  # the one grammar of shard keys, shared with every reader
from .layout import Layout

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


def encode_shard(rows: np.ndarray, g: PackGeometry) -> tuple[list[Any], list[int]]:
    """The bytes of one Zarr v3 shard holding ``rows`` ([k <= R, S] uint8), and row offsets.

    Exactly what zarr's sharding codec writes for this array (bytes codec, no compression,
    index at the end: (offset, nbytes) little-endian uint64 per inner chunk in row-major
    chunk order, 2**64-1 for absent chunks, then crc32c of the index) -- a test compares the
    two byte for byte. Written here because zarr's per-chunk pipeline costs ~100 us a row,
    while this is one memcpy-free gather of the rows we already hold contiguous.
    """
    k = rows.shape[0]
    if not 0 < k <= g.rows_per_shard:
        raise ValueError(f"a shard holds 1..{g.rows_per_shard} rows, got {k}")
    index = np.full((g.rows_per_shard, g.chunks_per_row, 2), _INDEX_EMPTY, dtype="<u8")
    row_stride = g.chunks_per_row * g.chunk_cols
    starts = np.arange(k, dtype=np.uint64) * np.uint64(row_stride)
    index[:k, :, 0] = starts[:, None] + np.arange(g.chunks_per_row, dtype=np.uint64)[None, :] * np.uint64(g.chunk_cols)
    index[:k, :, 1] = g.chunk_cols
    data = rows
    if row_stride != g.row_nbytes:  # the last column chunk of a big row is stored whole, zero-padded
        data = np.zeros((k, row_stride), dtype=np.uint8)
        data[:, : g.row_nbytes] = rows
    index_bytes = index.tobytes()
    crc = np.array([google_crc32c.value(index_bytes)], dtype="<u4").tobytes()
    return [np.ascontiguousarray(data), index_bytes + crc], [int(x) for x in starts]


class Pack:
    """Writer-side handle on one layout's array."""

    def __init__(self, storage: Storage, layout: Layout, geometry: PackGeometry, array: Any) -> None:
        self.storage = storage
        self.layout = layout
        self.geometry = geometry
        self._array = array
        # after a shard name was found taken (the previous writer's orphans): look before
        # planning, one shard at a time, instead of trusting the stored shape (our own failed
        # resize may have put a smaller one over theirs)
        self.probe_taken = False

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
        start = -(-max(index_next_row, self.nrows) // r) * r
        if self.probe_taken:
            while self.storage.exists(shard_key(self.layout.layout_id, start // r)):
                start += r
        return start

    def write_rows(
        self, start: int, rows: np.ndarray, *, crash: Callable[[str], None] | None = None,
        check: Callable[[], None] | None = None,
    ) -> list[RowPlacement]:
        """Write ``rows`` ([k, S] uint8) at ``start`` (a shard boundary) as new shards.

        ``check`` (the writer's lease check) runs right before the array's metadata is rewritten:
        that write is not conditional, and a writer that slept through a take-over would size it
        from its stale shape, hiding the new writer's rows from plain Zarr readers.
        """
        g = self.geometry
        k = rows.shape[0]
        if start % g.rows_per_shard:
            raise ValueError("rows must start at a shard boundary")
        if check is not None:
            check()
        # zarr writes the metadata itself, past the storage layer: retry its transient errors here
        # (only ever grown past the cached shape, start >= nrows: zarr deletes chunks outside a
        # smaller shape, and the cached one may lag the stored one)
        call_with_retry(self.storage.retry, self._array.resize, (start + k, g.row_nbytes))
        self.storage.make_durable([f"{pack_prefix(self.layout.layout_id)}/rows/zarr.json"])
        if crash is not None:
            crash("after_resize")
        out: list[RowPlacement] = []
        for s0 in range(start, start + k, g.rows_per_shard):
            chunk = rows[s0 - start : s0 - start + g.rows_per_shard]
            key = shard_key(self.layout.layout_id, s0 // g.rows_per_shard)
            parts, offsets = encode_shard(chunk, g)
            try:
                self.storage.create(key, parts)
            except ObjectExists:
                raise ShardTaken(f"shard {key} already exists (another writer on this store); "
                                 "not overwritten, nothing committed") from None
            out.extend(RowPlacement(s0 + i, key, off, g.row_nbytes) for i, off in enumerate(offsets))
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
