"""Reading only a rank's slice of a row, verified.

A content id hashes the whole row, so a read of part of it cannot be checked against it.
What can be: the first time a rank loads a row it reads it whole, verifies it against the
content id (as every read) and cuts its slice; it then records the xxh3-128 digest of that
slice (a *slice digest*, kept in memory per content id). Each later read of that row on
this rank (the host cache and the device slot both evicted it: LRU churn) reads only the
byte ranges of its slice straight from the row's shard (one ``pread`` per run of bytes)
and checks them against the slice digest before they reach a slot; a mismatch is an
:class:`IntegrityError`. So every
byte a slot receives is checked against the content id, directly or through a digest
derived from a verified read, and a rank reads its slice, not the row, from its second
load of a row on. Slice reads need a store whose rows are local files (a local directory
opened by the client); on an object store or through the service a row is read whole.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from mint_store import Location
from mint_store.errors import BlobNotFound, IntegrityError, StaleLocation
from mint_store.layout import DTYPES

if TYPE_CHECKING:
    from .tp import Cut, SlicedPool

MAX_DIGESTS = 1 << 20  # content ids remembered per rank (16 bytes each, plus the dict's own)


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
            # rows of B [.., out, r] (per leading index, a run per piece) or columns of A
            # [.., r, in] (per row of A, a run per piece)
            n, inner = (c.src.shape[-2], c.src.shape[-1]) if c.dim == len(c.src.shape) - 2 else (c.src.shape[-1], 1)
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


class SliceReader:
    """Per rank: slice digests of the rows it has verified, and the ranged reads that use them."""

    def __init__(self) -> None:
        self._digests: OrderedDict[str, str] = OrderedDict()
        self.bytes_read = 0  # storage bytes read by slice reads
        self.reads = 0

    def record(self, content_id: str, digest: str) -> None:
        self._digests[content_id] = digest
        self._digests.move_to_end(content_id)
        while len(self._digests) > MAX_DIGESTS:
            self._digests.popitem(last=False)

    def known(self, content_id: str) -> bool:
        return content_id in self._digests

    def read(self, store: Any, loc: Location, pool: SlicedPool) -> torch.Tensor:
        """This rank's sliced row of ``loc``, read by ranges and checked against its slice digest."""
        want = self._digests[loc.content_id]
        out = torch.zeros(pool.layout.row_nbytes, dtype=torch.uint8)  # zero padding, as a sliced copy leaves
        view = out.numpy().data
        try:
            for run in pool.runs:
                store.storage.read_into(loc.shard_key, loc.offset + run.src, view[run.dst : run.dst + run.nbytes])
        except BlobNotFound:
            raise StaleLocation(f"shard {loc.shard_key} is gone (compacted); resolve again") from None
        n = sum(run.nbytes for run in pool.runs)
        self.bytes_read += n
        self.reads += 1
        if slice_digest(pool.layout.layout_id, out) != want:
            self._digests.pop(loc.content_id, None)  # read it whole next time
            raise IntegrityError(
                f"this rank's slice of the row of content id {loc.content_id} in shard {loc.shard_key} at offset "
                f"{loc.offset} does not match the digest recorded when the whole row was verified; run `mint fsck`"
            )
        return out
