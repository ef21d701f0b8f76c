"""Block digests: per-block xxh3 digests of each row, so that a part of a row is verifiable.

A content id hashes a whole row, so a reader that wants only part of it (a rank of a
tensor-parallel engine: the rows of ``B`` of its output shard, the columns of ``A`` of its
input shard) cannot check that part against it. The writer therefore also records, at
publish, a digest per *block* of every row:

* ``M.lora_A`` ``[.., r, in]`` is cut into up to ``BLOCKS`` blocks of its ``in`` columns,
  ``M.lora_B`` ``[.., out, r]`` into up to ``BLOCKS`` blocks of its ``out`` rows (torch.chunk's
  split: the one DTensor's ``Shard`` uses; the count is the largest power of two up to
  ``BLOCKS`` that leaves blocks of at least ``MIN_BLOCK_BYTES``, so at TP = 1, 2, 4, 8 with
  dimensions that divide, a rank's slice of a large tensor is a whole number of blocks);
  every other tensor (``scaling``) is one block;
* in a row with fused-experts tensors (``[E, r, in]``, ``[E, out, r]``) the grid is *per expert*
  (``EXPERT_BLOCKS`` set in the grid's ``blocks``): each expert's matrix is cut as above on its
  own, so a rank of an expert-parallel engine reads and checks only its experts' blocks (the
  row's *MoE expert shards*), and a tensor-parallel rank still its columns or rows of each;
  readers older than this refuse such a table (its digest count does not fit their grid);
* a block's bytes are its elements in row-major order (all leading indices: every expert);
  its digest is ``xxh3_128("mint-block\\0" + layout_id + block number + bytes)``;
* only rows of at least ``MIN_ROW_BYTES`` get digests: slicing a small row saves less than
  a round trip, and a table costs 16 bytes per block (a small row would pay both in publish
  time and in storage overhead). The grid's two parameters are recorded in each table.

Binding the digests to the content id
-------------------------------------
The digests of all rows of one shard go in one *block table* object
(``blocks/<layout>/rows/c/<n>/0``), written create-only with the shard and before the
commit that names it. The commit's log event names, for that shard, the digest of the
table's index of rows (its *anchor*; each row's entry there holds the digest of its
record), and the index keeps the anchor in the shard's record. A reader takes the content id
and the anchor from the same place (the index, folded from the log, or the service, which
answers from its index): it checks the table against the anchor, then each block it read
against its digest. So a block is checked against a digest that is itself
checked against the commit that published the content id, both written by the writer from
the one buffer whose xxh3 is the content id; a damaged, stale or misplaced table or block
is an :class:`IntegrityError`, exactly the failures a content id check catches (xxh3 is no
defence against a forger who can write the log either way). Rows published before this
(or moved by a compaction, which writes no table) have no anchor: readers read them whole.

Old readers ignore the extra event field and record key and never look under ``blocks/``.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..errors import BlobNotFound, IntegrityError, StaleLocation
from .layout import DTYPES, Layout

BLOCKS = 8  # blocks per sliced dimension at most (TP 1, 2, 4 and 8 fall on block edges)
MIN_BLOCK_BYTES = 4096  # a tensor is cut into fewer blocks rather than smaller ones
MIN_ROW_BYTES = 256 * 1024  # smaller rows get no block digests: read whole
TABLE_PREFIX = "blocks/"
DIGEST = 16  # bytes of one block digest
EXPERT_BLOCKS = 1 << 16  # flag in Grid.blocks: expert tensors are cut per expert first


@dataclass(frozen=True, slots=True)
class Block:
    """One block of a row: runs ``(offset in the row, nbytes)`` read in order."""

    number: int
    tensor: str
    runs: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.runs)


def slice_dim(name: str, ndim: int) -> int | None:
    """The dimension a tensor-parallel rank slices: ``in`` of ``lora_A``, ``out`` of ``lora_B``."""
    kind = name.rpartition(".")[2]
    if kind == "lora_A":
        return ndim - 1
    if kind == "lora_B":
        return ndim - 2
    return None


def chunks(n: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk's split of ``n`` into at most ``k`` parts, as ``[start, stop)``."""
    step = -(-n // k) if n else 1
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def span_runs(offset: int, shape: tuple[int, ...], size: int, dim: int,
              start: int, stop: int) -> list[tuple[int, int]]:
    """The byte runs of ``[start, stop)`` along ``dim`` (the last or the one before) of a tensor at ``offset``."""
    if dim == len(shape) - 2:
        n, inner = shape[-2], shape[-1]
    else:
        n, inner = shape[-1], 1
    lead = 1
    for d in shape:
        lead *= d
    lead //= n * inner
    out: list[tuple[int, int]] = []
    for i in range(lead):
        src, nb = offset + (i * n + start) * inner * size, (stop - start) * inner * size
        if out and out[-1][0] + out[-1][1] == src:
            out[-1] = (out[-1][0], out[-1][1] + nb)
        else:
            out.append((src, nb))
    return out


@dataclass(frozen=True, slots=True)
class Grid:
    """The grid parameters a table records (readers cut rows the way the writer did)."""

    blocks: int = BLOCKS
    min_block: int = MIN_BLOCK_BYTES


def _count(nbytes: int, grid: Grid) -> int:
    k = grid.blocks & ~EXPERT_BLOCKS
    while k > 1 and nbytes < k * grid.min_block:
        k //= 2
    return max(k, 1)


def block_grid(layout: Layout, grid: Grid) -> tuple[Block, ...]:
    """Every block of a row of ``layout``, in digest order."""
    out: list[Block] = []
    per_expert = bool(grid.blocks & EXPERT_BLOCKS)
    for t in layout.tensors:
        size = DTYPES[t.dtype][1]
        dim = slice_dim(t.name, len(t.shape))
        if dim is None or t.numel == 0:
            out.append(Block(len(out), t.name, ((t.offset, t.nbytes),)))
            continue
        if per_expert and len(t.shape) == 3:  # each expert's matrix on its own
            each = t.nbytes // t.shape[0]
            for e in range(t.shape[0]):
                sub = tuple(t.shape[1:])
                for a, b in chunks(sub[dim - 1], _count(each, grid)):
                    runs = span_runs(t.offset + e * each, sub, size, dim - 1, a, b)
                    out.append(Block(len(out), f"{t.name}[{e}]", tuple(runs)))
            continue
        for a, b in chunks(t.shape[dim], _count(t.nbytes, grid)):
            out.append(Block(len(out), t.name, tuple(span_runs(t.offset, t.shape, size, dim, a, b))))
    return tuple(out)


_GRIDS: dict[tuple[str, Grid], tuple[Block, ...]] = {}


def grid_of(layout: Layout, grid: Grid) -> tuple[Block, ...]:
    key = (layout.layout_id, grid)
    blocks = _GRIDS.get(key)
    if blocks is None:
        if len(_GRIDS) > 1024:
            _GRIDS.clear()
        blocks = _GRIDS[key] = block_grid(layout, grid)
    return blocks


def merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` ranges sorted, adjacent and overlapping ones joined."""
    out: list[tuple[int, int]] = []
    for o, n in sorted(ranges):
        if out and o <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], o + n)
            out[-1] = (out[-1][0], end - out[-1][0])
        elif n > 0:
            out.append((o, n))
    return out


def blocks_touching(layout: Layout, grid: Grid, ranges: Sequence[tuple[int, int]]) -> tuple[Block, ...]:
    """The blocks of ``layout``'s grid that hold any byte of ``ranges`` (``(offset, nbytes)`` in the row)."""
    spans = merged(ranges)
    starts = [o for o, _ in spans]

    def overlaps(o: int, n: int) -> bool:
        i = bisect.bisect_right(starts, o + n - 1) - 1
        return i >= 0 and spans[i][0] + spans[i][1] > o

    return tuple(b for b in grid_of(layout, grid) if any(overlaps(o, n) for o, n in b.runs))


_PREFIX: dict[tuple[str, int], Any] = {}


def _hasher(layout_id: str, number: int) -> Any:
    """A hasher that has absorbed the block's prefix (copied per digest: no re-hash of it)."""
    key = (layout_id, number)
    base = _PREFIX.get(key)
    if base is None:
        if len(_PREFIX) > 1 << 16:
            _PREFIX.clear()
        base = _PREFIX[key] = xxhash.xxh3_128(b"mint-block\0" + layout_id.encode() + struct.pack("<I", number))
    return base.copy()


def block_digest(layout_id: str, number: int, parts: Sequence[Any]) -> bytes:
    """Digest of block ``number``: ``parts`` are its runs' bytes, in order."""
    h = _hasher(layout_id, number)
    for p in parts:
        h.update(p)
    return bytes(h.digest())


def row_digests(layout: Layout, rows: np.ndarray, grid: Grid) -> list[bytes]:
    """Per row of ``rows`` (``[n, row_nbytes]`` uint8): its block digests, concatenated.

    Per block, one gather of its runs over all rows (a block of a row contiguous), then one
    hash per row: the publish path's cost is one pass over the bytes plus a call per block."""
    rows = rows.reshape(-1, layout.row_nbytes)
    n = rows.shape[0]
    out = [bytearray() for _ in range(n)]
    lid = layout.layout_id
    for blk in grid_of(layout, grid):
        if len(blk.runs) == 1:
            o, k = blk.runs[0]
            data = rows[:, o : o + k]
        else:
            data = np.concatenate([rows[:, o : o + k] for o, k in blk.runs], axis=1)
        for i in range(n):
            h = _hasher(lid, blk.number)
            h.update(np.ascontiguousarray(data[i]) if len(blk.runs) == 1 else data[i])
            out[i] += h.digest()
    return [bytes(b) for b in out]


def table_key(shard_key: str) -> str:
    """The block table of shard ``packs/<layout>/rows/c/<n>/0``: ``blocks/<layout>/rows/c/<n>/0``."""
    return TABLE_PREFIX + shard_key.removeprefix("packs/")


def shard_of_table(key: str) -> str | None:
    """The shard key a block table belongs to, or None if ``key`` is no block table."""
    return "packs/" + key.removeprefix(TABLE_PREFIX) if key.startswith(TABLE_PREFIX) else None


# A table is fixed-size binary records rather than msgpack so that a reader fetches only its
# row's part with ranged reads (a shard holds up to 1024 small rows; their table would be
# megabytes): a header, an index of (content id, digest of that row's record) per row, the
# anchor hashing header and index; then one record (the row's block digests) per row.
_HEAD = struct.Struct("<8sIIII32s")  # magic, rows, record bytes, grid blocks, grid min block, layout id
_MAGIC = b"MINTBLK1"
_ENTRY = 32  # 16-byte content id + 16-byte digest of the row's record


@dataclass(frozen=True, slots=True)
class RowBlocks:
    """The block digests of one row and the grid they follow."""

    grid: Grid
    digests: bytes


def _h(data: Any) -> bytes:
    return bytes(xxhash.xxh3_128(data).digest())


def encode_table(layout_id: str, digests: dict[str, bytes], grid: Grid) -> tuple[bytes, list[Any]]:
    """A shard's block table (content id -> block digests) and its anchor ``[digest, rows, record bytes]``."""
    recs = list(digests.items())
    d = len(recs[0][1]) if recs else 0
    index = _HEAD.pack(_MAGIC, len(recs), d, grid.blocks, grid.min_block, layout_id.encode()) + b"".join(
        bytes.fromhex(cid) + _h(rec) for cid, rec in recs)
    return index + b"".join(rec for _, rec in recs), [_anchor_hash(index), len(recs), d]


def _anchor_hash(index: bytes) -> str:
    return str(xxhash.xxh3_128(b"mint-blocks\0" + index).hexdigest())


def shard_tables(layout: Layout, cids: Sequence[str], rows: np.ndarray,
                 shard_of: Sequence[str]) -> dict[str, tuple[bytes, list[Any]]]:
    """Per shard key: the block table of the rows written there and its anchor."""
    experts = any(len(t.shape) == 3 and slice_dim(t.name, 3) is not None for t in layout.tensors)
    grid = Grid(BLOCKS | (EXPERT_BLOCKS if experts else 0), MIN_BLOCK_BYTES)  # read now: a test may set them
    digests = row_digests(layout, rows, grid)
    per: dict[str, dict[str, bytes]] = {}
    for cid, d, key in zip(cids, digests, shard_of, strict=True):
        per.setdefault(key, {})[cid] = d
    return {key: encode_table(layout.layout_id, rows_, grid) for key, rows_ in per.items()}


def read_row_digests(storage: Any, shard_key: str, anchor: Any, content_id: str) -> RowBlocks | None:
    """The block digests of one row: its shard table's index checked against ``anchor`` (from
    the commit), then the row's record against its digest in that index. Two ranged reads."""
    key = table_key(shard_key)
    try:
        digest, n, d = str(anchor[0]), int(anchor[1]), int(anchor[2])
    except (TypeError, ValueError, IndexError, KeyError):
        raise IntegrityError(f"shard {shard_key} records a block table anchor of unknown form") from None
    try:
        index = storage.read_range(key, 0, _HEAD.size + n * _ENTRY)
        if len(index) != _HEAD.size + n * _ENTRY or _anchor_hash(index) != digest:
            raise IntegrityError(f"block table {key} does not match the digest its commit recorded; run `mint fsck`")
        _, _, _, blocks, min_block, _ = _HEAD.unpack_from(index)
        grid = Grid(int(blocks), int(min_block))
        want = bytes.fromhex(content_id)
        for i in range(n):
            at = _HEAD.size + i * _ENTRY
            if index[at : at + 16] == want:
                rec = storage.read_range(key, _HEAD.size + n * _ENTRY + i * d, d)
                if len(rec) != d or _h(rec) != index[at + 16 : at + 32]:
                    raise IntegrityError(f"block table {key}: the record of {content_id} does not match its "
                                         "digest; run `mint fsck`")
                return RowBlocks(grid, bytes(rec))
    except BlobNotFound:
        if not storage.exists(shard_key):  # swept with its shard since the location was resolved
            raise StaleLocation(f"shard {shard_key} is gone (compacted); resolve again") from None
        raise IntegrityError(f"block table {key} is missing though its commit recorded it; run `mint fsck`") from None
    return None


def check_digests(layout: Layout, got: RowBlocks) -> None:
    if len(got.digests) != DIGEST * len(grid_of(layout, got.grid)):
        raise IntegrityError(f"block digests of {len(got.digests)} bytes do not fit layout {layout.layout_id}")


def write_block_tables(storage: Any, layout: Layout, cids: Sequence[str], rows: np.ndarray,
                       shard_of: Sequence[str]) -> dict[str, list[Any]]:
    """Write the block table of every shard a commit wrote (create-only, before its log
    event); returns each shard's anchor for the event."""
    anchors: dict[str, list[Any]] = {}
    if layout.row_nbytes < MIN_ROW_BYTES:
        return anchors
    for key, (raw, anchor) in shard_tables(layout, cids, rows, shard_of).items():
        storage.create(table_key(key), raw)
        anchors[key] = anchor
    return anchors
