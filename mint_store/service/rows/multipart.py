"""Several ranges of a row in one answer (``multipart/byteranges``), and a row's block digests.

``GET /v1/blobs/{id}`` with ``Range: bytes=a-b,c-d,...`` answers ``206`` with one part per range
(RFC 9110 §14.6), read with one vectored read (:mod:`mint_store.read.vread`: ``pread`` per range
on a local pack, concurrent ranged GETs on S3). A tensor-parallel rank reads its slice of a row
this way, then checks every block it asked for against the digests of ``GET
/v1/blobs/{id}/blocks`` (:mod:`mint_store.format.blocks`, served by :mod:`..routes.blocks`). A
header with more than ``MAX_RANGES`` ranges, overlapping or unsorted ranges, or one that does
not parse is ignored and the whole row sent (RFC 9110 lets a server do so), never an error. No
part goes out unchecked (:mod:`.checks`): the blocks holding the ranges are checked against
their digests, or, for a row without them, the whole row against its content id (on a local pack
once per shard file, on S3 by reading the whole row, held under the budget).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Protocol

from aiohttp import web

from ...errors import BlobNotFound, StaleLocation
from ...results import Location
from ...storage import LocalStorage, Storage
from ..deadlines import deadline_paused, send_within
from ..errors import RangeNotSatisfiable
from ..slots import ByteBudget
from .checks import LocalRowCheck, PartCheck, check_location, verified_row

Resolver = Callable[[], Awaitable[Location]]  # the row's current location, for a retry after a move


class RowSender(Protocol):
    """What a multi-range answer needs of :class:`~..serving.RowSender` (which answers through
    this module: it must not be imported back)."""

    storage: Storage
    executor: Executor
    read_timeout: float
    buffers: ByteBudget
    local_storage: LocalStorage | None
    local: bool
    check: LocalRowCheck
    parts: PartCheck | None
    on_bytes: Callable[[str, int], None]

WRITE_PIECE = 1 * 2**20  # bytes per write of an answer (parts gathered up to this, larger ones split)
MAX_RANGES = 8192  # a TP rank of a large adapter asks for ~ one range per row of each row-parallel A
_ONE = re.compile(r"\s*([0-9]{1,18})-([0-9]{1,18})\s*")


def parse_ranges(header: str | None, size: int) -> list[tuple[int, int]] | None:
    """The ``[start, stop)`` ranges of a multi-range header (``first-last`` forms only), or None
    for anything else (a single range is :func:`~.parse_range`'s)."""
    if not header or "," not in header or not header.startswith("bytes="):
        return None
    parts = header[len("bytes="):].split(",")
    if len(parts) > MAX_RANGES:
        return None
    out: list[tuple[int, int]] = []
    for p in parts:
        m = _ONE.fullmatch(p)
        if m is None:
            return None
        first, last = int(m.group(1)), int(m.group(2))
        if last < first or (out and first < out[-1][1]):
            return None  # malformed, overlapping or unsorted: the whole row instead
        if first < size:  # an unsatisfiable range is dropped (RFC 9110 §14.2)
            out.append((first, min(last + 1, size)))
    if not out:
        raise RangeNotSatisfiable(f"no range of {header[:100]!r} lies inside the row ({size} bytes)",
                                  headers={"Content-Range": f"bytes */{size}"})
    return out


async def send_ranges(sender: RowSender, request: web.Request, loc: Location, resolve: Resolver,
                      ranges: list[tuple[int, int]], headers: dict[str, str], *, route: str,
                      owner: str = "") -> web.StreamResponse:
    """``206 multipart/byteranges``: every range read first (so a stale location is re-resolved
    before any header goes out), then written in pieces of at most ``WRITE_PIECE`` bytes. The
    ranges' bytes are held under the sender's byte budget (more such answers wait); a HEAD
    reads nothing."""
    nbytes = sum(b - a for a, b in ranges)
    boundary = os.urandom(12).hex()
    heads = [(f"--{boundary}\r\nContent-Type: application/octet-stream\r\n"
              f"Content-Range: bytes {a}-{b - 1}/{loc.length}\r\n\r\n").encode() for a, b in ranges]
    tail = f"\r\n--{boundary}--\r\n".encode()
    resp = web.StreamResponse(status=206, headers=headers)
    resp.headers["Content-Type"] = f"multipart/byteranges; boundary={boundary}"
    resp.content_length = sum(len(h) for h in heads) + nbytes + 2 * (len(ranges) - 1) + len(tail)
    if request.method == "HEAD":
        await resp.prepare(request)
        await resp.write_eof()
        return resp
    # on S3 the whole row is read to be checked (service/rows/checks.py): that much is held
    async with sender.buffers.hold(nbytes if sender.local else max(nbytes, loc.length), owner):
        data = await _read(sender, loc, resolve, ranges)
        await resp.prepare(request)
        with deadline_paused(request, None):
            out = bytearray()
            view, pos = memoryview(data), 0
            for i, (h, (a, b)) in enumerate(zip(heads, ranges, strict=True)):
                out += (b"\r\n" if i else b"") + h
                for at in range(pos, pos + b - a, WRITE_PIECE):  # a large range: piece by piece
                    out += view[at : min(at + WRITE_PIECE, pos + b - a)]
                    if len(out) >= WRITE_PIECE:
                        await send_within(request, resp.write(bytes(out)), sender.read_timeout)
                        out.clear()
                pos += b - a
            out += tail
            await send_within(request, resp.write(bytes(out)), sender.read_timeout)
    sender.on_bytes(route, nbytes)
    await resp.write_eof()
    return resp


async def _read(sender: RowSender, loc: Location, resolve: Resolver, ranges: list[tuple[int, int]]) -> bytearray:
    """The ranges' bytes back to back: one vectored read, again at a re-resolved location if
    compaction moved the row meanwhile."""
    loop = asyncio.get_running_loop()

    def read(at: Location) -> bytearray:
        check_location(at)
        if sender.local_storage is not None:
            held = sender.local_storage.hold(at.shard_key)  # the ranges come from the file checked
            try:
                if sender.check.known(held.fd, at) or sender.parts is None:
                    sender.check.verify_fd(held.fd, at)
                    return _pread_ranges(held.fd, at, ranges)
            finally:
                sender.local_storage.release(held)
        part = sender.parts.read(at, ranges) if sender.parts is not None else None
        if part is not None:  # the blocks holding the ranges, each checked against its digest
            return part
        if sender.local_storage is not None:  # no block digests: the row is checked whole
            held = sender.local_storage.hold(at.shard_key)
            try:
                sender.check.verify_fd(held.fd, at)
                return _pread_ranges(held.fd, at, ranges)
            finally:
                sender.local_storage.release(held)
        row = sender.storage.read_range(at.shard_key, at.offset, at.length)  # S3: the whole row, checked
        verified_row(at, row)
        return bytearray(b"".join(row[a:b] for a, b in ranges))

    try:
        return await loop.run_in_executor(sender.executor, read, loc)
    except BlobNotFound:
        loc = await resolve()
        try:
            return await loop.run_in_executor(sender.executor, read, loc)
        except BlobNotFound:
            raise StaleLocation(f"shard {loc.shard_key} is gone; resolve again") from None


def _pread_ranges(fd: int, loc: Location, ranges: list[tuple[int, int]]) -> bytearray:
    buf = bytearray()
    for a, b in ranges:
        piece = os.pread(fd, b - a, loc.offset + a)
        if len(piece) != b - a:
            raise BlobNotFound(f"object {loc.shard_key!r} is shorter than its row")
        buf += piece
    return buf
