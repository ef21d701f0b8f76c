"""Vectored reads: several byte ranges of one object in one call.

* a local file: one ``preadv`` per range into the caller's buffers (POSIX has no call that
  reads several *file* offsets at once; the ranges go back to back on a cached descriptor);
* S3 (s3fs): one ranged GET per range, all in flight together (s3fs ``cat_ranges``). S3
  answers a multi-range ``Range`` header with the whole object or one range, never a
  multipart body, so concurrent ranged GETs are the only way to read several ranges in about
  one round trip;
* any other fsspec filesystem: ``cat_ranges`` likewise.

Ranges are ``(offset, nbytes)`` in the object; adjacent ones should be merged by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .blocks import RowBlocks, read_row_digests
from .errors import BlobNotFound, IntegrityError, StaleLocation
from .records import Location
from .storage import FsspecStorage, LocalStorage, Storage


def read_ranges_into(storage: Storage, key: str, ranges: Sequence[tuple[int, int]],
                     bufs: Sequence[memoryview]) -> None:
    """Fill ``bufs[i]`` with ``ranges[i]`` of object ``key``; BlobNotFound if it is gone or short."""
    if isinstance(storage, LocalStorage):
        for (off, n), buf in zip(ranges, bufs, strict=True):
            storage.read_into(key, off, buf[:n])
        return
    if isinstance(storage, FsspecStorage):
        path = storage._path(key)
        try:
            got = storage.fs.cat_ranges([path] * len(ranges), [o for o, _ in ranges],
                                        [o + n for o, n in ranges], on_error="raise")
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {storage.url}") from None
        for (off, n), data, buf in zip(ranges, got, bufs, strict=True):
            if isinstance(data, BaseException):
                raise data
            if len(data) != n:
                raise BlobNotFound(f"object {key!r} is shorter than {off + n} bytes")
            buf[:n] = data
        return
    for (off, n), buf in zip(ranges, bufs, strict=True):  # any other Storage: its own reads
        storage.read_into(key, off, buf[:n])


def read_row_ranges(store: Any, loc: Location, ranges: Sequence[tuple[int, int]], out: Any) -> int:
    """Read ``ranges`` (offsets within the row of ``loc``) into the same offsets of ``out`` (a
    row-sized writable buffer). Nothing is verified here: the caller checks each block.
    Returns the bytes read."""
    view = memoryview(out).cast("B")
    for off, n in ranges:
        if off < 0 or n < 0 or off + n > loc.length:
            raise IntegrityError(f"range ({off}, {n}) is outside the row of {loc.content_id} ({loc.length} bytes)")
    try:
        read_ranges_into(store.storage, loc.shard_key, [(loc.offset + o, n) for o, n in ranges],
                         [view[o : o + n] for o, n in ranges])
    except BlobNotFound:
        raise StaleLocation(f"shard {loc.shard_key} is gone (compacted); resolve again") from None
    return sum(n for _, n in ranges)


def row_block_digests(store: Any, loc: Location) -> RowBlocks | None:
    """The block digests the writer recorded for the row of ``loc`` (checked against its
    commit's anchor), or None for a row published without them (read it whole)."""
    with store._idx().read() as t:  # the shard's record: where the commit put the anchor
        rec = t.get("shards", loc.shard_key.encode())
    anchor = rec.get("blocks") if isinstance(rec, dict) else None
    if anchor is None:
        return None
    return read_row_digests(store.storage, loc.shard_key, anchor, loc.content_id)

