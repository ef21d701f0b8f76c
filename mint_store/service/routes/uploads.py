"""Multipart uploads of PEFT files, streamed to a temporary file with limits enforced as bytes arrive.

Nothing is held whole in memory: ``adapter_model.safetensors`` goes to a temp file once
``upload_buffer`` bytes have gathered (writes run on the executor) while it is counted and
hashed; ``adapter_config.json`` is small and capped. Every byte of the body counts against
``body_limit`` -- preamble, boundaries and part headers too -- and every read must make
progress within ``read_timeout``. Whatever happens -- a limit, a malformed body, a client
that goes away -- the temp file is removed when the context exits.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from ...errors import MintError
from ..deadlines import deadline_paused, within
from ..errors import BadRequest, BodyTooLarge, UnsupportedMediaType

CONFIG_PART = "adapter_config.json"
WEIGHTS_PART = "adapter_model.safetensors"
PARTS = (CONFIG_PART, WEIGHTS_PART)
_READ = 256 * 1024
_FLUSH = 1 * 2**20
_PART_TYPES = {
    CONFIG_PART: {"", "application/json", "text/plain", "application/octet-stream"},
    WEIGHTS_PART: {"", "application/octet-stream", "application/x-safetensors", "application/safetensors"},
}
T = TypeVar("T")
_PLAIN_ENCODINGS = {"", "identity", "binary", "7bit", "8bit"}
HEADER_EXPANSION = 20  # decode memory per safetensors header byte (see Upload.decode_nbytes)


@dataclass(frozen=True, slots=True)
class UploadLimits:
    body: int
    config: int
    read_timeout: float = 30.0  # no body bytes for this long: 408
    buffer: int = _FLUSH  # weights bytes held in memory before a write to the temp file
    rearm: float | None = None  # the whole-request deadline once the body is in (None: keep it paused)


@dataclass(frozen=True, slots=True)
class Upload:
    """A received upload: the config bytes and the weights in a temp file."""

    config: bytes
    weights_path: str
    weights_nbytes: int
    weights_sha256: str
    header_nbytes: int = 0  # the safetensors header length its first 8 bytes claim (0: none, or past the file)

    @property
    def decode_nbytes(self) -> int:
        """Memory a decode of these weights may take: the file, plus its header's entries (each
        ~55 bytes of JSON becomes a dict, a checked entry and a tensor: ~1 KiB, measured)."""
        return self.weights_nbytes + HEADER_EXPANSION * self.header_nbytes


class _Sink:
    """The temp file of the weights part; writes and hashing run on the executor."""

    def __init__(self, fd: int, executor: Executor, flush_at: int) -> None:
        self.fd = fd
        self.executor = executor
        self.flush_at = flush_at
        self.hash = hashlib.sha256()
        self.buf = bytearray()
        self.nbytes = 0
        self.peak = 0  # most bytes held in ``buf`` at once
        self.head = b""  # the first 8 bytes: the safetensors header length

    def header_nbytes(self) -> int:
        n = int.from_bytes(self.head, "little") if len(self.head) == 8 else 0
        return n if n <= self.nbytes - 8 else 0  # (a header past the file is refused at decode, unread)

    def _write(self, data: bytes) -> None:
        self.hash.update(data)
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    async def add(self, chunk: bytes) -> None:
        if len(self.head) < 8:
            self.head += chunk[: 8 - len(self.head)]
        self.buf += chunk
        self.nbytes += len(chunk)
        self.peak = max(self.peak, len(self.buf))
        if len(self.buf) >= self.flush_at:
            await self.flush()

    async def flush(self) -> None:
        if self.buf:
            data, self.buf = bytes(self.buf), bytearray()
            await asyncio.get_running_loop().run_in_executor(self.executor, self._write, data)


def _part_name(part: BodyPartReader) -> str:
    for candidate in (part.name, part.filename):
        if candidate in PARTS:
            return str(candidate)
    shown = part.name or part.filename or "(unnamed)"
    raise BadRequest(f"unexpected multipart part {shown!r}; send exactly {PARTS[0]!r} and {PARTS[1]!r}")


def _check_part(name: str, part: BodyPartReader) -> None:
    ctype = part.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if ctype not in _PART_TYPES[name]:
        raise UnsupportedMediaType(f"part {name!r} has content type {ctype!r}; expected one of "
                                   f"{sorted(t for t in _PART_TYPES[name] if t)}")
    for header in ("Content-Encoding", "Content-Transfer-Encoding"):
        if part.headers.get(header, "").strip().lower() not in _PLAIN_ENCODINGS:
            raise UnsupportedMediaType(f"part {name!r}: {header} {part.headers[header]!r} is not supported")


class _BodyStream:
    """The request body as the multipart reader sees it, with every read guarded.

    Each read must return within ``read_timeout``; after each, the bytes the connection has
    delivered so far (``total_bytes``: preamble, boundaries and part headers included) must
    be within ``limit``. aiohttp pauses the socket once its buffer is full, so at most one
    buffer's worth arrives past the limit before the 413.
    """

    def __init__(self, stream: Any, limit: int, read_timeout: float) -> None:
        self._stream = stream
        self._limit = limit
        self._timeout = read_timeout

    async def _guard(self, step: Awaitable[T]) -> T:
        got = await within(step, self._timeout, "receiving the request body")
        received = getattr(self._stream, "total_bytes", 0)
        if received > self._limit:
            raise BodyTooLarge(f"body is over the limit of {self._limit} bytes (every byte counts, "
                               "part headers and preamble included)")
        return got

    async def read(self, n: int = -1) -> bytes:
        return await self._guard(self._stream.read(n))

    async def readline(self, *, max_line_length: int | None = None) -> bytes:
        return await self._guard(self._stream.readline(max_line_length=max_line_length))

    async def readany(self) -> bytes:
        return await self._guard(self._stream.readany())

    async def readexactly(self, n: int) -> bytes:
        return await self._guard(self._stream.readexactly(n))

    def __getattr__(self, name: str) -> Any:  # at_eof, unread_data, ...: not reads
        return getattr(self._stream, name)


@asynccontextmanager
async def receive_upload(
    request: web.Request,
    *,
    limits: UploadLimits,
    executor: Executor,
    tmp_dir: str | None = None,
    on_bytes: Callable[[int], None] | None = None,
    on_buffered: Callable[[int], None] | None = None,
) -> AsyncIterator[Upload]:
    """Read a ``multipart/form-data`` upload of the two PEFT files; yield it; clean up.

    The whole-request deadline is paused while the body arrives (``read_timeout`` bounds
    each read instead). ``on_buffered`` gets the most bytes this upload held in memory.
    """
    if request.content_type != "multipart/form-data":
        raise UnsupportedMediaType(
            f"expected multipart/form-data with parts {PARTS[0]!r} and {PARTS[1]!r}, "
            f"got {request.content_type!r}"
        )
    declared = request.content_length
    if declared is not None and declared > limits.body:
        raise BodyTooLarge(f"body of {declared} bytes is over the limit of {limits.body} bytes")
    # create and unlink synchronously (one cheap syscall each): the unlink must also run
    # when the handler is cancelled, where awaiting the executor is not possible
    fd, path = tempfile.mkstemp(prefix="mint-upload-", suffix=".safetensors", dir=tmp_dir)
    try:
        sink = _Sink(fd, executor, limits.buffer)
        with deadline_paused(request, limits.rearm):
            config = await _read_parts(request, sink, limits, on_bytes)
        await sink.flush()
        if on_buffered is not None:
            on_buffered(sink.peak + len(config))
        yield Upload(config, path, sink.nbytes, sink.hash.hexdigest(), sink.header_nbytes())
    finally:
        os.close(fd)
        os.unlink(path)


async def _read_parts(
    request: web.Request, sink: _Sink, limits: UploadLimits, on_bytes: Callable[[int], None] | None
) -> bytes:
    seen: dict[str, bytes | None] = {}
    size = min(_READ, max(limits.buffer, 4096))
    try:
        stream = _BodyStream(request.content, limits.body, limits.read_timeout)
        reader = MultipartReader(request.headers, stream,  # type: ignore[arg-type]  # reads like one
                                 max_field_size=request.protocol.max_field_size,
                                 max_headers=request.protocol.max_headers)
        while True:
            part = await reader.next()
            if part is None:
                break
            if not isinstance(part, BodyPartReader):
                raise UnsupportedMediaType("nested multipart parts are not accepted")
            name = _part_name(part)
            if name in seen:
                raise BadRequest(f"part {name!r} appears twice")
            _check_part(name, part)
            config = bytearray()
            while chunk := await part.read_chunk(size):
                if on_bytes is not None:
                    on_bytes(len(chunk))
                if name == CONFIG_PART:
                    config += chunk
                    if len(config) > limits.config:
                        raise BodyTooLarge(f"part {name!r} is over the limit of {limits.config} bytes")
                else:
                    await sink.add(chunk)
            seen[name] = bytes(config) if name == CONFIG_PART else None
    except (ValueError, RuntimeError, AssertionError, HttpProcessingError, web.RequestPayloadError,
            asyncio.IncompleteReadError, EOFError) as e:
        # aiohttp's multipart reader reports malformed or truncated bodies as ValueError, part
        # headers over its limits as HttpProcessingError, and a `_charset_` part it reads itself
        # as RuntimeError (a long value) or AssertionError (a boundary over 30 characters)
        if isinstance(e, MintError):
            raise
        raise BadRequest(f"malformed or truncated multipart body: {e or type(e).__name__}") from None
    missing = [p for p in PARTS if p not in seen]
    if missing:
        raise BadRequest(f"missing multipart part(s) {missing}; send {PARTS[0]!r} and {PARTS[1]!r}")
    return seen[CONFIG_PART] or b""
