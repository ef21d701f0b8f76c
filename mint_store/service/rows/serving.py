"""Serving row bytes: one Range, an ETag that is the content id, sendfile for local packs.

A local row goes out with ``loop.sendfile`` on the shard file at the offset the index
recorded (aiohttp's FileResponse only serves whole files). An S3 row is read whole, under
the byte budget, and sent in pieces of at most ``S3_CHUNK`` bytes; a range of a row with
block digests is read as the blocks that hold it. Either way nothing goes out before the
row's place and bytes are checked (:mod:`.checks`): the index is folded from the log,
and a planted location must never send a tenant another file's bytes.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ...errors import BlobNotFound, StaleLocation
from ...results import Location
from ...storage import LocalStorage, Storage
from ..deadlines import deadline_paused, send_within
from ..errors import RangeNotSatisfiable
from ..slots import ByteBudget
from .checks import BlocksOf, LocalRowCheck, PartCheck, check_location, verified_row
from .multipart import Resolver, parse_ranges, send_ranges

S3_CHUNK = 8 * 2**20
SMALL_ROW = 64 * 1024  # local rows up to this size are copied, larger ones go out with sendfile
_FALLBACK_CHUNK = 1 * 2**20
SENDFILE_PIECE = 4 * 2**20  # one sendfile call; a reader must take this much within read_timeout
_RANGE_RE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
_MAX_DIGITS = 18  # any longer position is past every row anyway: clamp before int() (4,300-digit limit)


@dataclass(frozen=True, slots=True)
class ByteRange:
    start: int
    stop: int  # exclusive

    @property
    def length(self) -> int:
        return self.stop - self.start


def parse_range(header: str | None, size: int) -> ByteRange | None:
    """The one range a ``Range`` header asks for; None to send everything.

    Several ranges, or a header that does not parse, are ignored (RFC 9110 lets a server
    answer 200 with the whole representation). A range past the end is unsatisfiable.
    """
    if not header:
        return None
    m = _RANGE_RE.fullmatch(header.strip())
    if m is None:
        return None
    first, last = _position(m.group(1)), _position(m.group(2))
    shown = header if len(header) <= 100 else header[:100] + "..."
    if first is not None:
        start = first
        if last is not None and last < start:
            return None
        if start >= size:
            raise RangeNotSatisfiable(f"range {shown!r} starts at or past the end ({size} bytes)",
                                      headers={"Content-Range": f"bytes */{size}"})
        stop = min(last + 1, size) if last is not None else size
        return ByteRange(start, stop)
    if last is None:
        return None  # "bytes=-" is not a range
    if last == 0:
        raise RangeNotSatisfiable(f"range {shown!r} asks for no bytes", headers={"Content-Range": f"bytes */{size}"})
    return ByteRange(max(0, size - last), size)


def _position(digits: str) -> int | None:
    """A Range position; absurdly long ones become 10**18, past the end of every row."""
    if not digits:
        return None
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= _MAX_DIGITS else 10**_MAX_DIGITS


class _HeldFile(io.FileIO):
    """A shard's descriptor from local storage's cache, as a file sendfile takes; ``held`` is
    the storage's hold on it, given back when the answer is done (the storage closes it)."""

    held: Any


class RowSender:
    """Sends rows (or one range of a row) from the store's storage."""

    def __init__(self, storage: Storage, executor: Executor, *, on_bytes: Callable[[str, int], None],
                 read_timeout: float = 30.0, buffers: ByteBudget | None = None,
                 blocks_of: BlocksOf | None = None) -> None:
        self.storage = storage
        self.executor = executor
        self.read_timeout = read_timeout  # a client that reads nothing for this long is cut off
        # what answers that hold rows in memory (multi-range, exports) may hold at once: a slow
        # reader keeps its buffer for as long as it keeps reading, so many of them must wait
        self.buffers = buffers or ByteBudget(2**30)
        # local shards are sent from the storage's own descriptor cache (held per answer)
        self.local_storage = storage if isinstance(storage, LocalStorage) else None
        self.on_bytes = on_bytes
        self.local = self.local_storage is not None  # a local directory: sendfile works
        self.check = LocalRowCheck()  # local rows verified once per shard file (service/rows/checks.py)
        # parts of rows checked block by block where their commit recorded block digests
        self.parts = PartCheck(storage, blocks_of) if blocks_of is not None else None

    def written(self, rows: list[tuple[str, int, int, str]]) -> None:
        """Rows this process's writer wrote (``Store.add_rows_listener``): a local row is known
        verified from the start, so its first answer does not hash it again (:meth:`.LocalRowCheck.seed`)."""
        if self.local_storage is not None:
            self.check.seed(self.local_storage.local_path, rows)

    def _open(self, loc: Location) -> _HeldFile:
        """The shard's file, held in the storage's cache: the caller gives it back (:meth:`_done`).
        Held, it is never closed under the answer: closed under a running sendfile, its number
        would go to the next file opened, and the answer would go on in that file's bytes."""
        storage = self.local_storage
        if storage is None:  # pragma: no cover - only called for local storage
            raise StaleLocation("not a local store")
        try:
            held = storage.hold(loc.shard_key)
        except BlobNotFound:
            raise StaleLocation(f"shard {loc.shard_key} is gone") from None
        f = _HeldFile(held.fd, "r", closefd=False)
        f.held = held
        return f

    def _done(self, f: _HeldFile) -> None:
        f.close()  # (closefd=False: the descriptor stays the storage's)
        assert self.local_storage is not None
        self.local_storage.release(f.held)

    def open_checked(self, loc: Location) -> _HeldFile:
        """Blocking (not on the loop): a local row's held shard file, the row checked as a GET
        checks it (hashed once per shard file, or known); :meth:`release` it when done.
        StaleLocation if the shard is gone (re-resolve), IntegrityError if the row is not its
        content id's. The same-machine copies use it (:mod:`..local_copy`)."""
        f = self._open(loc)
        try:
            self.check.verify_fd(f.fileno(), loc)
        except BaseException:
            self._done(f)
            raise
        return f

    release = _done  # a file from open_checked back to the storage

    async def send(
        self, request: web.Request, loc: Location, resolve: Resolver, *, route: str, owner: str = ""
    ) -> web.StreamResponse:
        """The row of ``loc`` (or the ranges asked for); ``owner``: the caller whose share of the
        byte budget a multi-range answer holds."""
        etag = loc.content_id
        check_location(loc)  # never a read outside the pack the index names (service/rows/checks.py)
        if _etag_matches(request.headers.get("If-None-Match"), etag):
            resp = web.StreamResponse(status=304, headers=_headers(loc))
            return resp
        rng: ByteRange | None = None
        if_range = request.headers.get("If-Range")
        if if_range is None or if_range.strip().strip('"') == etag:
            multi = parse_ranges(request.headers.get("Range"), loc.length)  # several: multipart/byteranges
            if multi is not None:
                return await send_ranges(self, request, loc, resolve, multi, _headers(loc), route=route,
                                         owner=owner)
            rng = parse_range(request.headers.get("Range"), loc.length)
        span = rng or ByteRange(0, loc.length)
        head_only = request.method == "HEAD"
        if not self.local and not head_only:  # the whole row is held to be checked before it is sent
            async with self.buffers.hold(loc.length, owner):
                return await self._send_span(request, loc, resolve, span, rng, route)
        return await self._send_span(request, loc, resolve, span, rng, route)

    async def _send_span(self, request: web.Request, loc: Location, resolve: Resolver, span: ByteRange,
                         rng: ByteRange | None, route: str) -> web.StreamResponse:
        # the first read (or open), and the check of the row, happen before any header goes out,
        # so a location that went stale (compaction) can still be re-resolved and answered cleanly
        head_only = request.method == "HEAD"
        first: bytes | io.FileIO
        try:
            first, base = await self._first(loc, span, head_only)
        except StaleLocation:
            loc = await resolve()
            check_location(loc)
            first, base = await self._first(loc, span, head_only)
        try:
            return await self._answer(request, loc, span, rng, first, base, route)
        finally:
            if isinstance(first, _HeldFile):
                self._done(first)

    async def _answer(self, request: web.Request, loc: Location, span: ByteRange, rng: ByteRange | None,
                      first: bytes | io.FileIO, base: int, route: str) -> web.StreamResponse:
        """``first``: the held shard file, or checked bytes of the row from offset ``base`` on."""
        head_only = request.method == "HEAD"
        resp = web.StreamResponse(status=206 if rng else 200, headers=_headers(loc))
        if rng is not None:
            resp.headers["Content-Range"] = f"bytes {span.start}-{span.stop - 1}/{loc.length}"
        resp.content_length = span.length
        await resp.prepare(request)
        if head_only:
            await resp.write_eof()
            return resp
        # a slow reader is not the server's work: the whole-request deadline is paused and
        # each write must make progress within read_timeout instead
        with deadline_paused(request, None):
            if isinstance(first, io.FileIO) and span.length <= SMALL_ROW:
                # setting up a sendfile costs more than copying a small row; a page-cache
                # pread blocks no longer than sendfile's own read of the same pages would
                data = os.pread(first.fileno(), span.length, loc.offset + span.start)
                await send_within(request, resp.write(data), self.read_timeout)
            elif isinstance(first, io.FileIO):
                await self._sendfile(request, resp, first, loc.offset + span.start, span.length)
            else:  # bytes checked (the row, or the span's blocks): the span of them, piece by piece
                view = memoryview(first)
                for at in range(span.start - base, span.stop - base, S3_CHUNK):
                    await send_within(request, resp.write(view[at : min(at + S3_CHUNK, span.stop - base)]),
                                      self.read_timeout)
        self.on_bytes(route, span.length)
        await resp.write_eof()
        return resp

    async def _first(self, loc: Location, span: ByteRange, head_only: bool) -> tuple[bytes | io.FileIO, int]:
        """What the answer sends from, and the row offset its bytes start at: a local row's held
        shard file, its row checked (a small row: the row's bytes, checked); an S3 row's bytes,
        read whole and checked; a part of a row with block digests: its blocks' bytes, each block
        checked (:class:`.checks.PartCheck`). Nothing is checked for a HEAD (it sends none)."""
        loop = asyncio.get_running_loop()
        part = span.length < loc.length and self.parts is not None and not head_only
        if self.local:
            f = self._open(loc)
            if head_only:
                return f, 0
            try:
                if part and not await loop.run_in_executor(self.executor, self.check.known, f.fileno(), loc):
                    data = await self._part(loc, span)
                    if data is not None:
                        self._done(f)
                        return data, span.start
                if loc.length <= SMALL_ROW:  # copied out (see _answer): the file goes back at once
                    data = await loop.run_in_executor(self.executor, self.check.read_verified, f.fileno(), loc)
                    self._done(f)
                    return data, 0
                await loop.run_in_executor(self.executor, self.check.verify_fd, f.fileno(), loc)
            except BaseException:
                self._done(f)
                raise
            return f, 0
        if head_only:
            return b"", 0
        if part:
            data = await self._part(loc, span)
            if data is not None:
                return data, span.start
        data = await self._read(loc, 0, loc.length)
        verified_row(loc, data)
        return data, 0

    async def _part(self, loc: Location, span: ByteRange) -> bytes | None:
        assert self.parts is not None
        loop = asyncio.get_running_loop()
        try:
            got = await loop.run_in_executor(self.executor, self.parts.read, loc, [(span.start, span.stop)])
        except BlobNotFound:
            raise StaleLocation(f"shard {loc.shard_key} is gone") from None
        return None if got is None else bytes(got)

    async def _read(self, loc: Location, start: int, n: int) -> bytes:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self.executor, self.storage.read_range, loc.shard_key, loc.offset + start, n
            )
        except BlobNotFound:
            raise StaleLocation(f"shard {loc.shard_key} is gone") from None

    async def _sendfile(
        self, request: web.Request, resp: web.StreamResponse, f: io.FileIO, offset: int, count: int
    ) -> None:
        loop = asyncio.get_running_loop()
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("client went away")
        sent = 0
        try:
            while sent < count:  # in pieces: each must go out within read_timeout
                n = min(SENDFILE_PIECE, count - sent)
                await send_within(request, loop.sendfile(transport, f, offset + sent, n, fallback=False),
                                  self.read_timeout)
                sent += n
            return
        except (asyncio.SendfileNotAvailableError, NotImplementedError):
            pass
        # no sendfile on this transport: pread, never the shared file position
        fd = f.fileno()
        while sent < count:
            n = min(_FALLBACK_CHUNK, count - sent)
            chunk = await loop.run_in_executor(self.executor, os.pread, fd, n, offset + sent)
            if not chunk:
                raise ConnectionResetError("shard shorter than its recorded row")
            await send_within(request, resp.write(chunk), self.read_timeout)
            sent += len(chunk)


def _headers(loc: Location) -> dict[str, str]:
    return {
        "Content-Type": "application/octet-stream",
        "ETag": f'"{loc.content_id}"',
        "Accept-Ranges": "bytes",
        # a content id always names the same bytes; auth makes caches private
        "Cache-Control": "private, max-age=31536000, immutable",
        "X-Mint-Content-Id": loc.content_id,
        "X-Mint-Layout-Id": loc.layout_id,
    }


def _etag_matches(header: str | None, etag: str) -> bool:
    if not header:
        return False
    tags = [t.strip().removeprefix("W/").strip('"') for t in header.split(",")]
    return "*" in tags or etag in tags
