"""One JSON parser for untrusted documents: configs, safetensors headers, request bodies, token files.

``json.loads`` accepts things that later turn into 500s or hangs: ``NaN``/``Infinity``
(not JSON, and they break every client that re-parses the value), numbers that overflow
to ``inf`` (``1e400``), integers over Python's 4,300-digit conversion limit (a bare
``ValueError``), and nesting deep enough for ``RecursionError`` here or in whatever
walks the result later. :func:`loads` refuses all of them with a ``ValueError`` whose
message says what was wrong; callers turn it into their typed error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

MAX_DEPTH = 32
MAX_INT_DIGITS = 64
MAX_FLOAT_CHARS = 64


def loads(
    raw: str | bytes | bytearray,
    *,
    max_depth: int | None = MAX_DEPTH,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """Parse ``raw``; raise ValueError (JSONDecodeError included) for anything not plain, bounded JSON.

    ``max_depth=None`` skips the nesting walk (for documents whose shape the caller checks
    fully anyway); parser recursion is still caught.
    """
    try:
        doc = json.loads(
            raw,
            parse_int=_int,
            parse_float=_float,
            parse_constant=_constant,
            object_pairs_hook=object_pairs_hook,
        )
    except RecursionError:
        raise ValueError(f"JSON nests too deeply (more than {max_depth or MAX_DEPTH} levels)") from None
    if max_depth is not None:
        check_depth(doc, max_depth)
    return doc


def check_depth(doc: Any, max_depth: int) -> None:
    """Refuse ``doc`` if lists/objects nest more than ``max_depth`` levels (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(doc, 1)] if isinstance(doc, dict | list) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > max_depth:
                    raise ValueError(f"JSON nests more than {max_depth} levels deep")
                stack.append((child, depth + 1))


def _int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"integer of {digits} digits is too large (at most {MAX_INT_DIGITS} digits)")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_FLOAT_CHARS:
        raise ValueError(f"number {text[:20]}... of {len(text)} characters is too long")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range (it overflows to infinity)")
    return value


def _constant(token: str) -> Any:
    raise ValueError(f"{token} is not valid JSON (only finite numbers are)")
