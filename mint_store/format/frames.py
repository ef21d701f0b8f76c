"""Length-prefixed msgpack frames: the wire of the service's Unix socket (:mod:`..service.local_copy`).

A frame is a 4-byte big-endian length and a msgpack map of at most ``MAX_FRAME`` bytes; the
service and its client (``engine_client.client.local_rows``) both speak it through these.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

MAX_FRAME = 64 * 1024  # a request or a report is a few hundred bytes
HEAD = struct.Struct(">I")


def pack(msg: dict[str, Any]) -> bytes:
    """``msg`` as one frame."""
    data = msgpack.packb(msg)
    return HEAD.pack(len(data)) + data


def size_of(head: bytes) -> int:
    """The body length a frame's head gives; ValueError past ``MAX_FRAME``."""
    (n,) = HEAD.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes: at most {MAX_FRAME}")
    return int(n)


def unpack(body: bytes) -> Any:
    """A frame's body decoded; ValueError if it is not msgpack."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"not a msgpack frame ({e})") from None


def recv_exact(conn: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``conn``; EOFError if it closes first."""
    buf = bytearray()
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            raise EOFError("the connection closed inside a frame")
        buf += got
    return bytes(buf)
