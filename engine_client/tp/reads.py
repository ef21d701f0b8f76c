"""Reading only a rank's slice of a row, verified, from the first read on.

A content id hashes the whole row, so part of a row cannot be checked against it. The
writer records at publish a digest per *block* of every row (:mod:`mint_store.format.blocks`:
``BLOCKS`` blocks along the ``in`` columns of each ``lora_A`` and the ``out`` rows of each
``lora_B``, each other tensor one block), anchored in the commit that published the content
id. The first load of a row on a rank:

* fetches the row's block digests (``client.row_blocks``: checked against the anchor);
* reads, with one vectored read (``client.read_ranges``: ``pread`` per range on local
  files, concurrent ranged GETs on S3, one multi-range ``Range`` request through the
  service), only the blocks that overlap this rank's slice, checks each against its digest
  (a mismatch is an :class:`IntegrityError`), and cuts the slice from them;
* records the xxh3-128 digest of the slice itself (a *slice digest*, per content id, in
  memory), so that a later load of the row (LRU churn) reads exactly the slice's byte runs
  and checks them against that one digest.

At TP = 1, 2, 4, 8 with dimensions the block count divides, the blocks a rank needs are
exactly its slice: the first read is slice-only too. A row published without block digests
(older stores, or moved by a compaction) is read whole and verified against its content id;
its slice digest is recorded on the copy into the slot, as before. So every byte a slot
receives is checked against the content id: directly, through the block digests the
content id's commit anchors, or through a slice digest derived from one of those.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import xxhash

from mint_store import Location
from mint_store.errors import IntegrityError
from mint_store.format.blocks import (
    DIGEST,
    Block,
    Grid,
    RowBlocks,
    block_digest,
    blocks_touching,
    check_digests,
)
from mint_store.format.layout import DTYPES, Layout, TensorSpec
from mint_store.read.buffers import empty_row
from mint_store.read.vread import read_row_ranges, row_block_digests

MAX_DIGESTS = 1 << 20  # content ids remembered per rank (16 bytes each, plus the dict's own)


@dataclass(frozen=True, slots=True)
class Cut:
    """One tensor of a stored row and its slice on this rank (``dim`` None: whole)."""

    src: TensorSpec
    dst: TensorSpec
    dim: int | None
    pieces: tuple[tuple[int, int], ...]  # [start, stop) ranges along dim, concatenated


class SlicedRows(Protocol):
    """What a slice read needs of its pool (:class:`~..sharding.SlicedPool`, which reads through
    this module: it must not be imported back)."""

    source: Layout  # the stored layout
    slice_ranges: list[tuple[int, int]]  # the byte ranges of a stored row that make this rank's slice

    @property
    def layout(self) -> Layout: ...  # the sliced layout (the slots')

    def slice_row(self, row: torch.Tensor) -> torch.Tensor: ...

    def blocks_needed(self, grid: Grid) -> tuple[tuple[Block, ...], list[tuple[int, int]]]: ...


@dataclass(frozen=True, slots=True)
class Run:
    """``nbytes`` from ``src`` (offset in the stored row) to ``dst`` (offset in the sliced row)."""

    src: int
    dst: int
    nbytes: int


def runs_of(cuts: tuple[Cut, ...]) -> tuple[Run, ...]:
    """The byte runs of a row that make this rank's sliced row, adjacent ones merged."""
    out: list[Run] = []
    for c in cuts:
        size = DTYPES[c.src.dtype][1]
        parts: list[Run] = []
        if c.dim is None:
            parts.append(Run(c.src.offset, c.dst.offset, c.src.nbytes))
        else:
            # per leading index, a run per piece: rows of B [.., out, r], columns of A [.., r, in],
            # experts of A or B [E, .., ..] (an expert-parallel rank's experts: one run per piece)
            n, inner = c.src.shape[c.dim], 1
            for d in c.src.shape[c.dim + 1 :]:
                inner *= d
            dst = c.dst.offset
            for lead in range(c.src.numel // (n * inner)):
                for a, b in c.pieces:
                    parts.append(Run(c.src.offset + (lead * n + a) * inner * size, dst, (b - a) * inner * size))
                    dst += (b - a) * inner * size
        for p in parts:
            last = out[-1] if out else None
            if last is not None and last.src + last.nbytes == p.src and last.dst + last.nbytes == p.dst:
                out[-1] = Run(last.src, last.dst, last.nbytes + p.nbytes)
            else:
                out.append(p)
    return tuple(out)


def slice_digest(layout_id: str, sliced: Any) -> str:
    """Digest of a sliced row (bytes of this rank's layout, its padding included)."""
    h = xxhash.xxh3_128(b"mint-slice\0" + layout_id.encode())
    h.update(sliced.numpy().data if isinstance(sliced, torch.Tensor) else sliced)
    return str(h.hexdigest())


class RowIO(Protocol):
    """How a rank reads part of a row: a local store directly, or the engine's client."""

    def read_ranges(self, loc: Location, ranges: list[tuple[int, int]], out: Any) -> int: ...

    def row_blocks(self, loc: Location) -> RowBlocks | None: ...


class StoreIO:
    """Rows of a store opened in this process (any thread may call it)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def read_ranges(self, loc: Location, ranges: list[tuple[int, int]], out: Any) -> int:
        return read_row_ranges(self.store, loc, ranges, out)

    def row_blocks(self, loc: Location) -> RowBlocks | None:
        return row_block_digests(self.store, loc)


class ClientIO:
    """Rows through the engine's client (S3, the service), on its I/O loop."""

    def __init__(self, call: Callable[[Awaitable[Any]], Any], client: Any) -> None:
        self.call, self.client = call, client

    def read_ranges(self, loc: Location, ranges: list[tuple[int, int]], out: Any) -> int:
        return int(self.call(self.client.read_ranges(loc, ranges, out)))

    def row_blocks(self, loc: Location) -> RowBlocks | None:
        got: RowBlocks | None = self.call(self.client.row_blocks(loc))
        return got


def blocks_needed(source: Any, runs: tuple[Run, ...], grid: Grid) -> tuple[Block, ...]:
    """The blocks of ``source``'s grid that hold any byte of ``runs`` (this rank's slice)."""
    return blocks_touching(source, grid, [(r.src, r.nbytes) for r in runs])


class SliceReader:
    """Per rank: slice digests of the rows it has verified, and the ranged reads that use them."""

    def __init__(self) -> None:
        self._digests: OrderedDict[str, str] = OrderedDict()
        self._no_blocks: OrderedDict[str, None] = OrderedDict()  # rows published without block digests
        self.bytes_read = 0  # storage bytes read by slice reads
        self.reads = 0

    def record(self, content_id: str, digest: str) -> None:
        self._digests[content_id] = digest
        self._digests.move_to_end(content_id)
        while len(self._digests) > MAX_DIGESTS:
            self._digests.popitem(last=False)

    def known(self, content_id: str) -> bool:
        return content_id in self._digests

    def read_slice(self, io: RowIO, loc: Location, pool: SlicedRows) -> tuple[torch.Tensor, int] | None:
        """This rank's sliced row of ``loc`` and the bytes read, or None: read it whole."""
        if loc.content_id in self._digests:
            return self._read_known(io, loc, pool)
        if loc.content_id in self._no_blocks:
            return None
        got = io.row_blocks(loc)
        if got is None:
            self._no_blocks[loc.content_id] = None
            while len(self._no_blocks) > MAX_DIGESTS:
                self._no_blocks.popitem(last=False)
            return None
        return self._read_blocks(io, loc, pool, got)

    def _read_known(self, io: RowIO, loc: Location, pool: SlicedRows) -> tuple[torch.Tensor, int]:
        want = self._digests[loc.content_id]
        buf = empty_row(loc.length)  # only the slice's runs are read, and only they are used
        n = io.read_ranges(loc, pool.slice_ranges, buf)
        out = pool.slice_row(torch.from_numpy(buf))
        self._count(n)
        if slice_digest(pool.layout.layout_id, out) != want:
            self._digests.pop(loc.content_id, None)  # read it afresh next time
            raise IntegrityError(
                f"this rank's slice of the row of content id {loc.content_id} in shard {loc.shard_key} at offset "
                f"{loc.offset} does not match the digest recorded when it was first verified; run `mint fsck`"
            )
        return out, n

    def _read_blocks(self, io: RowIO, loc: Location, pool: SlicedRows,
                     got: RowBlocks) -> tuple[torch.Tensor, int]:
        check_digests(pool.source, got)
        digests = got.digests
        needed, ranges = pool.blocks_needed(got.grid)
        buf = empty_row(loc.length)
        n = io.read_ranges(loc, ranges, buf)
        self._count(n)
        lid = pool.source.layout_id
        for b in needed:
            seen = block_digest(lid, b.number, [buf[o : o + k] for o, k in b.runs])
            if seen != digests[DIGEST * b.number : DIGEST * (b.number + 1)]:
                raise IntegrityError(
                    f"block {b.number} ({b.tensor}) of the row of content id {loc.content_id} in shard "
                    f"{loc.shard_key} at offset {loc.offset} does not match the digest its commit recorded; "
                    "run `mint fsck`"
                )
        out = pool.slice_row(torch.from_numpy(buf))  # reads only bytes inside the checked blocks
        self.record(loc.content_id, slice_digest(pool.layout.layout_id, out))
        return out, n

    def _count(self, n: int) -> None:
        self.bytes_read += n
        self.reads += 1
