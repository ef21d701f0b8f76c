"""Several byte ranges of a row in one HTTP request: a standard multi-range ``Range`` header.

Ranges whose header would pass ``MAX_HEADER`` bytes go in several such requests, sent at
once. The service answers ``206`` with a ``multipart/byteranges`` body (RFC 9110 §14.6), one part
per range, each with its ``Content-Range``; a single range comes back as a plain ``206``;
a server that ignores ``Range`` (allowed) sends the whole row, ``200``, and the ranges are
cut from it. Nothing here is verified: the caller checks every block it asked for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import aiohttp

from mint_store import Location
from mint_store.errors import IntegrityError

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
MAX_HEADER = 6000  # bytes of one Range header (under the 8190 most servers, the service too, accept)


def range_header(ranges: Sequence[tuple[int, int]]) -> str:
    """``bytes=a-b,c-d`` for ``(offset, nbytes)`` ranges (inclusive ends, as RFC 9110 writes them)."""
    return "bytes=" + ",".join(f"{o}-{o + n - 1}" for o, n in ranges if n > 0)


def range_groups(ranges: Sequence[tuple[int, int]], limit: int = MAX_HEADER) -> list[list[tuple[int, int]]]:
    """``ranges`` in consecutive groups whose ``Range`` header stays within ``limit`` bytes."""
    groups: list[list[tuple[int, int]]] = []
    size = limit
    for o, n in ranges:
        if n <= 0:
            continue
        item = len(f"{o}-{o + n - 1},")
        if size + item > limit:
            groups.append([])
            size = len("bytes=")
        groups[-1].append((o, n))
        size += item
    return groups


def _place(loc: Location, view: memoryview, header: str | None, data: bytes) -> int:
    m = _CONTENT_RANGE.fullmatch((header or "").strip())
    if m is None:
        raise IntegrityError(f"row {loc.content_id}: a ranged answer without a valid Content-Range ({header!r})")
    start, last, size = (int(g) for g in m.groups())
    if size != loc.length or last < start or last >= size or len(data) != last - start + 1:
        raise IntegrityError(f"row {loc.content_id}: part {header!r} of {len(data)} bytes does not fit the row "
                             f"({loc.length} bytes)")
    view[start : last + 1] = data
    return len(data)


async def fill_ranges(resp: aiohttp.ClientResponse, loc: Location, ranges: Sequence[tuple[int, int]],
                      view: memoryview) -> int:
    """Write the answer to a ranged GET of ``loc``'s row into ``view`` (row offsets); bytes received."""
    if resp.status == 200:  # the whole row: the server ignored the ranges
        data = await resp.read()
        if len(data) != loc.length:
            raise IntegrityError(f"row {loc.content_id}: server sent {len(data)} bytes, expected {loc.length}")
        for o, n in ranges:
            view[o : o + n] = data[o : o + n]
        return len(data)
    ctype = resp.headers.get("Content-Type", "")
    if not ctype.startswith("multipart/byteranges"):
        return _place(loc, view, resp.headers.get("Content-Range"), await resp.read())
    got = 0
    reader = aiohttp.MultipartReader(resp.headers, resp.content)
    while True:
        part = await reader.next()
        if part is None:
            return got
        if not isinstance(part, aiohttp.BodyPartReader):
            raise IntegrityError(f"row {loc.content_id}: a nested multipart part in a byteranges answer")
        got += _place(loc, view, part.headers.get("Content-Range"), bytes(await part.read(decode=False)))
