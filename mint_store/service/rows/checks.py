"""What row serving checks before any byte of a row goes out: its place, and its bytes.

The service answers rows with sendfile or ranged reads straight from the shard the index
names, and the index is folded from the log, data anyone who can write to the store could
have planted. So before a row (or any range of it) is sent:

* its location is one the writer produces: the shard key is of the pack of the layout the
  index names (:func:`mint_store.format.keys.check_shard_key`), offset and length are not negative,
  and on a local pack the row lies inside the shard file;
* its bytes hash to its content id -- the whole row (a content id covers the whole row). On a
  local pack a row verified once is not hashed again while the shard file is the same file:
  same device, inode, size, mtime and ctime (``ctime`` changes with any write, and no one can
  set it back); shard objects are create-only and never rewritten, so this holds for as long
  as the store is intact. A row this process's writer wrote counts as verified from the start
  (:meth:`LocalRowCheck.seed`: its content id was computed from the bytes it wrote), for the
  file's identity right after the write. On S3 an answer of a whole row reads and checks all of it first;
* a part of a row (ranges: a tensor-parallel rank's slice, an expert-parallel rank's experts)
  whose commit recorded block digests (:mod:`mint_store.format.blocks`) is checked block by block
  instead (:class:`PartCheck`): every block holding a byte asked for is read and checked
  against its digest, itself checked against the commit's anchor, so a rank's read costs the
  server its blocks' bytes, not the row's (and a damaged byte elsewhere in the row fails no
  rank that does not read it). A row without digests, or a part whose blocks are the whole
  row, is checked whole.

A row that fails is :class:`~mint_store.errors.IntegrityError` (500 ``integrity_error``) and
nothing of it is sent; one whose shard is gone is :class:`~mint_store.errors.StaleLocation`.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ...errors import BlobNotFound, IntegrityError
from ...format.blocks import DIGEST, Block, RowBlocks, block_digest, blocks_touching, check_digests, merged
from ...format.keys import check_shard_key
from ...format.layout import Layout
from ...read.verified import RowCheck, hash_fd
from ...read.vread import read_ranges_into, row_block_digests
from ...results import Location
from ...storage import Storage

VERIFIED_MAX = 65_536  # local rows remembered as verified (an entry is ~200 bytes)
PLANS_MAX = 256  # (layout, grid, ranges) -> blocks to read: a TP rank asks for the same ranges again

_Plan = tuple[tuple[Block, ...], list[tuple[int, int]]]  # blocks touched, their runs merged

BlocksOf = Callable[[Location], "tuple[Layout, RowBlocks] | None"]
"""A row's layout and block digests (checked against its commit's anchor), None without digests."""


def check_location(loc: Location) -> None:
    """IntegrityError unless ``loc`` is a place the writer could have put a row of its layout."""
    check_shard_key(loc.shard_key, loc.layout_id, where=f"the index's location of {loc.content_id}")
    if loc.offset < 0 or loc.length < 0:
        raise IntegrityError(f"the index places {loc.content_id} at offset {loc.offset}, length {loc.length} of "
                             f"{loc.shard_key}: not a place in a shard; not served")


def hashes_to(loc: Location, data: bytes | bytearray | memoryview) -> bool:
    """Whether the whole row ``data`` is the row ``loc`` names (its content id)."""
    check = RowCheck(loc)
    check.update(data)
    return check.matches()


def _bad_bytes(loc: Location) -> IntegrityError:
    return IntegrityError(f"the bytes at {loc.shard_key}@{loc.offset}+{loc.length} do not hash to {loc.content_id} "
                          "(damaged, or a location planted in the index): not served; run `mint fsck`")


class LocalRowCheck:
    """Verification of rows read from local shard files (called in an executor: it reads)."""

    def __init__(self) -> None:
        self._verified: OrderedDict[tuple[int, ...], str] = OrderedDict()
        self._lock = threading.Lock()  # executor threads share the cache

    def _ident(self, fd: int, loc: Location) -> tuple[int, ...]:
        st = os.fstat(fd)
        if loc.offset + loc.length > st.st_size:
            raise IntegrityError(f"the index places {loc.content_id} past the end of {loc.shard_key} "
                                 f"({loc.offset}+{loc.length} > {st.st_size} bytes): not served")
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, loc.offset, loc.length)

    def known(self, fd: int, loc: Location) -> bool:
        """Whether the row at ``loc`` in ``fd`` was verified whole (IntegrityError if it lies past the file's end)."""
        ident = self._ident(fd, loc)
        with self._lock:
            if self._verified.get(ident) == loc.content_id:
                self._verified.move_to_end(ident)
                return True
        return False

    def verify_fd(self, fd: int, loc: Location, head: bytes | None = None) -> None:
        """IntegrityError unless the row at ``loc`` in the open shard ``fd`` lies inside the
        file and hashes to its content id. ``head``: the row's bytes already read (a small row)."""
        if self.known(fd, loc):
            return
        ident = self._ident(fd, loc)
        if head is not None:
            ok = hashes_to(loc, head)
        else:  # the read path's own check, chunk by chunk through one small buffer
            try:
                hash_fd(fd, loc)
                ok = True
            except BlobNotFound:
                raise IntegrityError(f"{loc.shard_key} is shorter than the row the index places in it") from None
            except IntegrityError:
                ok = False
        if not ok:
            raise _bad_bytes(loc)
        self._remember(ident, loc.content_id)

    def seed(self, path_of: Callable[[str], str | None], rows: Iterable[tuple[str, int, int, str]]) -> None:
        """Remember as verified rows that this process's writer has just written:
        ``(shard key, offset, length, content id)``, each content id computed from the very bytes
        written there, so a row published here is not hashed again for its first answer. Keyed
        like every entry by the file's identity (inode, size, times) as it is now, once the
        writer created it: a file changed or replaced since has another identity and is checked
        at its first answer, as is any location the index gives that the writer did not write."""
        by_key: dict[str, list[tuple[int, int, str]]] = {}
        for key, offset, length, content_id in rows:
            by_key.setdefault(key, []).append((offset, length, content_id))
        for key, items in by_key.items():
            path = path_of(key)
            if path is None:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue  # (gone already: nothing to answer from)
            for offset, length, content_id in items:
                if offset + length <= st.st_size:
                    self._remember((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, offset, length),
                                   content_id)

    def _remember(self, ident: tuple[int, ...], content_id: str) -> None:
        with self._lock:
            self._verified[ident] = content_id
            while len(self._verified) > VERIFIED_MAX:
                self._verified.popitem(last=False)

    def read_verified(self, fd: int, loc: Location) -> bytes:
        """The whole (small: it stays in cache) row from ``fd``, checked."""
        data = os.pread(fd, loc.length, loc.offset)
        if len(data) != loc.length:
            raise IntegrityError(f"{loc.shard_key} is shorter than the row the index places in it")
        self.verify_fd(fd, loc, head=data)
        return data


def verified_row(loc: Location, data: bytes | bytearray) -> None:
    """IntegrityError unless ``data`` (a whole row read from an object store) is ``loc``'s row."""
    if len(data) != loc.length or not hashes_to(loc, data):
        raise _bad_bytes(loc)


def _bad_block(loc: Location, number: int, tensor: str) -> IntegrityError:
    return IntegrityError(f"block {number} ({tensor}) of the row of content id {loc.content_id} in shard "
                          f"{loc.shard_key} at offset {loc.offset} does not match the digest its commit recorded "
                          "(damaged, or a location planted in the index): not served; run `mint fsck`")


class PartCheck:
    """Parts of rows read and checked block by block (called in an executor: it reads).

    ``blocks_of`` gives a row's layout and block digests (the service: from its index and the
    shard's block table, checked against the commit's anchor)."""

    def __init__(self, storage: Storage, blocks_of: BlocksOf) -> None:
        self.storage = storage
        self.blocks_of = blocks_of
        self._plans: OrderedDict[tuple[str, int, int, tuple[tuple[int, int], ...]], _Plan | None] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, loc: Location, ranges: Sequence[tuple[int, int]]) -> bytearray | None:
        """The bytes of ``ranges`` (``[start, stop)`` in the row, sorted) back to back, every
        block holding any of them read and checked; None when the row has no block digests or
        those blocks are the whole row (check it whole instead). IntegrityError on a bad block;
        BlobNotFound if the shard is gone or short."""
        got = self.blocks_of(loc)
        if got is None:
            return None
        layout, digests = got
        if layout.row_nbytes != loc.length:
            raise IntegrityError(f"the index places {loc.content_id} in {loc.length} bytes; its layout "
                                 f"{layout.layout_id} has rows of {layout.row_nbytes}: not served")
        check_digests(layout, digests)
        plan = self._plan(layout, digests, ranges)
        if plan is None:
            return None
        needed, runs = plan
        # [covered bytes] the runs of the blocks touched, back to back
        buf = np.empty(sum(n for _, n in runs), dtype=np.uint8)
        whole = memoryview(buf.data)
        views, pos, starts = [], 0, []
        for _, n in runs:
            views.append(whole[pos : pos + n])
            starts.append(pos)
            pos += n
        read_ranges_into(self.storage, loc.shard_key, [(loc.offset + o, n) for o, n in runs], views)
        run_at = [o for o, _ in runs]

        def at(o: int) -> int:  # where row offset o (inside a run) lies in buf
            i = bisect.bisect_right(run_at, o) - 1
            return starts[i] + o - run_at[i]

        lid = layout.layout_id
        for b in needed:
            seen = block_digest(lid, b.number, [buf[at(o) : at(o) + n] for o, n in b.runs])
            if seen != digests.digests[DIGEST * b.number : DIGEST * (b.number + 1)]:
                raise _bad_block(loc, b.number, b.tensor)
        out = bytearray()
        for a, z in ranges:
            out += buf[at(a) : at(a) + z - a].data
        return out

    def _plan(self, layout: Layout, got: RowBlocks, ranges: Sequence[tuple[int, int]]) -> _Plan | None:
        """The blocks touching ``ranges`` and their runs, merged; None when those runs are the
        whole row or some byte asked for lies in no block (the padding between tensors)."""
        key = (layout.layout_id, got.grid.blocks, got.grid.min_block, tuple(ranges))
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
                return self._plans[key]
        needed = blocks_touching(layout, got.grid, [(a, z - a) for a, z in ranges])
        runs = merged([r for b in needed for r in b.runs])
        run_at = [o for o, _ in runs]
        plan: _Plan | None = (needed, runs)
        for a, z in ranges:  # each range must lie inside one merged run
            i = bisect.bisect_right(run_at, a) - 1
            if i < 0 or runs[i][0] + runs[i][1] < z:
                plan = None
                break
        if plan is not None and sum(n for _, n in runs) >= layout.row_nbytes:
            plan = None
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > PLANS_MAX:
                self._plans.popitem(last=False)
        return plan


def store_blocks(store: Any) -> BlocksOf:
    """A :data:`BlocksOf` answered from ``store``'s index and block tables (layouts kept: an id is its table's hash)."""
    layouts: dict[str, Layout] = {}

    def blocks_of(loc: Location) -> tuple[Layout, RowBlocks] | None:
        got = row_block_digests(store, loc)
        if got is None:
            return None
        layout = layouts.get(loc.layout_id)
        if layout is None:
            if len(layouts) > 4096:
                layouts.clear()
            layout = layouts[loc.layout_id] = store.layout(loc.layout_id)
        return layout, got

    return blocks_of
