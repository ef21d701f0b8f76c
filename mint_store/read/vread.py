"""Vectored reads: several byte ranges of one object in one call.

* a local file: one ``preadv`` per range into the caller's buffers (POSIX has no call that
  reads several *file* offsets at once; the ranges go back to back on a cached descriptor);
* S3 (s3fs): ranged GETs, all in flight together (s3fs ``cat_ranges``). S3 answers a
  multi-range ``Range`` header with the whole object or one range, never a multipart body,
  so concurrent ranged GETs are the only way to read several ranges in about one round
  trip. Ranges less than ``GAP`` bytes apart share one GET (the bytes between are fetched
  and dropped): a request costs more than that much transfer, and a tensor-parallel rank's
  slice of a large adapter is otherwise a GET per row of every row-parallel ``A``;
* any other fsspec filesystem: ``cat_ranges`` likewise.

Ranges are ``(offset, nbytes)`` in the object, in ascending order; adjacent ones should be
merged by the caller. The reads return the bytes fetched (gaps included).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import BlobNotFound, IntegrityError, StaleLocation
from ..format.blocks import RowBlocks, read_row_digests
from ..results import Location
from ..storage import FsspecStorage, LocalStorage, Storage
from ..storage.remote import range_not_satisfiable

GAP = 32 * 1024  # on an object store, ranges closer than this share one GET


def spans(ranges: Sequence[tuple[int, int]], gap: int) -> list[tuple[int, int, list[int]]]:
    """``(start, stop, indices of ranges)`` of the GETs that fetch ``ranges``, gaps under ``gap`` bridged."""
    out: list[tuple[int, int, list[int]]] = []
    for i, (o, n) in enumerate(ranges):
        if out and o - out[-1][1] < gap and o >= out[-1][0]:
            start, stop, idx = out[-1]
            out[-1] = (start, max(stop, o + n), [*idx, i])
        else:
            out.append((o, o + n, [i]))
    return out


def read_ranges_into(storage: Storage, key: str, ranges: Sequence[tuple[int, int]],
                     bufs: Sequence[memoryview]) -> int:
    """Fill ``bufs[i]`` with ``ranges[i]`` of object ``key``; the bytes fetched. BlobNotFound if
    the object is gone or short."""
    if isinstance(storage, LocalStorage):
        for (off, n), buf in zip(ranges, bufs, strict=True):
            storage.read_into(key, off, buf[:n])
        return sum(n for _, n in ranges)
    if isinstance(storage, FsspecStorage):
        path = storage._path(key)
        gets = spans(ranges, GAP)
        try:
            got = storage.fs.cat_ranges([path] * len(gets), [g[0] for g in gets], [g[1] for g in gets],
                                        on_error="raise")
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {storage.url}") from None
        except OSError as e:
            if range_not_satisfiable(e):  # a range past the end: the object is short, as on disk
                raise BlobNotFound(f"object {key!r} is shorter than {gets[-1][1]} bytes") from None
            raise
        for (start, stop, idx), data in zip(gets, got, strict=True):
            if isinstance(data, BaseException):
                raise data
            if len(data) != stop - start:
                raise BlobNotFound(f"object {key!r} is shorter than {stop} bytes")
            for i in idx:
                o, n = ranges[i]
                bufs[i][:n] = data[o - start : o - start + n]
        return sum(stop - start for start, stop, _ in gets)
    for (off, n), buf in zip(ranges, bufs, strict=True):  # any other Storage: its own reads
        storage.read_into(key, off, buf[:n])
    return sum(n for _, n in ranges)


def read_row_ranges(store: Any, loc: Location, ranges: Sequence[tuple[int, int]], out: Any) -> int:
    """Read ``ranges`` (offsets within the row of ``loc``) into the same offsets of ``out`` (a
    row-sized writable buffer). Nothing is verified here: the caller checks each block.
    Returns the bytes fetched from storage."""
    view = memoryview(out).cast("B")
    for off, n in ranges:
        if off < 0 or n < 0 or off + n > loc.length:
            raise IntegrityError(f"range ({off}, {n}) is outside the row of {loc.content_id} ({loc.length} bytes)")
    try:
        return read_ranges_into(store.storage, loc.shard_key, [(loc.offset + o, n) for o, n in ranges],
                                [view[o : o + n] for o, n in ranges])
    except BlobNotFound:
        raise StaleLocation(f"shard {loc.shard_key} is gone (compacted); resolve again") from None


def row_block_digests(store: Any, loc: Location) -> RowBlocks | None:
    """The block digests the writer recorded for the row of ``loc`` (checked against its
    commit's anchor), or None for a row published without them (read it whole)."""
    with store.index_snapshot() as t:  # the shard's record: where the commit put the anchor
        rec = t.get("shards", loc.shard_key.encode())
    anchor = rec.get("blocks") if isinstance(rec, dict) else None
    if anchor is None:
        return None
    return read_row_digests(store.storage, loc.shard_key, anchor, loc.content_id)

