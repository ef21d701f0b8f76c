"""Small request helpers: query parameters, bounded JSON bodies, the route label of metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from ...format import strict_json
from ..deadlines import deadline_paused, within
from ..errors import BadRequest, BodyTooLarge, UnsupportedMediaType

INLINE_JSON_BYTES = 64 * 1024  # parsed on the event loop up to this size (well under a millisecond)


def route_label(request: web.Request) -> str:
    """The route's pattern (``/v1/adapters/{tenant}``): bounded label values for metrics."""
    info = request.match_info
    route = info.route if info is not None else None
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else "unmatched"


def int_param(request: web.Request, name: str, *, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    if not text.isascii() or not text.isdigit() or len(text) > 19:
        raise BadRequest(f"query parameter {name}={text!r} is not a non-negative integer")
    value = int(text)
    if not low <= value <= high:
        raise BadRequest(f"query parameter {name}={value} is not in {low}..{high}")
    return value


def float_param(request: web.Request, name: str, *, default: float, low: float, high: float) -> float:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise BadRequest(f"query parameter {name}={text!r} is not a number") from None
    if not low <= value <= high:  # NaN fails this too
        raise BadRequest(f"query parameter {name}={text} is not in {low}..{high}")
    return value


async def json_body(request: web.Request, limit: int, *, read_timeout: float, rearm: float | None) -> Any:
    """The request's JSON body, read in chunks up to ``limit`` bytes; every JSON route uses this.

    As an upload's: the time the body takes to arrive is not counted in the request's deadline
    (restarted with ``rearm`` s once it is in), and a body that sends nothing for
    ``read_timeout`` s is a 408 (a stalled body held its connection for the whole deadline).
    Parsed by :func:`mint_store.format.strict_json.loads`: nesting, integer digits and non-finite
    numbers are bounded, so a hostile body is a 400, never a RecursionError (500).
    """
    if request.content_type not in ("application/json", "application/octet-stream") and request.body_exists:
        raise UnsupportedMediaType(f"expected application/json, got {request.content_type!r}")
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"JSON body of {request.content_length} bytes is over the limit of {limit}")
    buf = bytearray()
    with deadline_paused(request, rearm):
        while chunk := await within(request.content.read(64 * 1024), read_timeout, "receiving the request body"):
            buf += chunk
            if len(buf) > limit:
                raise BodyTooLarge(f"JSON body is over the limit of {limit} bytes")
    try:
        if len(buf) <= INLINE_JSON_BYTES:
            return strict_json.loads(buf)
        # off the event loop: the bounds' checks run Python per value, ~0.4 s per MiB of small
        # numbers, which would stall every other request (the loop still gets the GIL meanwhile)
        return await asyncio.to_thread(strict_json.loads, buf)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, depth, digits, NaN
        raise BadRequest(f"body is not valid JSON: {e}") from None
