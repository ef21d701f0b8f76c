"""A row read over HTTP straight into its buffer, on the calling thread: no event loop.

:class:`~.http_transport.HttpMintClient` receives a body as aiohttp's chunks, each a new bytes
object copied into the row, on its event loop's thread. A caller that blocks anyway (vLLM's
worker loads an adapter inside a step, on a CPU it may share with nothing else) pays for that
twice: a second copy of every byte, and a thread hop plus a Python iteration per chunk. Measured
in vLLM's CPU worker (``tools/bench_vllm.py``), a 37 MB row took 33-57 ms that way. Here the
standard library's ``http.client`` ``readinto`` has the kernel copy the socket's bytes
straight into the destination, 1 MiB at a time, and each piece is hashed while it is in cache
(:class:`mint_store.read.RowCheck`).

The semantics are ``HttpMintClient.read_row``'s: ``GET /v1/blobs/<content id>``; typed
errors from the ``{"error": code}`` body; connection errors and retryable 5xx retried with
backoff, never a 4xx; a body of the wrong length or content is an IntegrityError. One
keep-alive connection per thread.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse
from typing import Any

from mint_store import Location
from mint_store.errors import IntegrityError, MintError
from mint_store.read import RowCheck
from mint_store.read.buffers import row_buffer

from ..errors import TERMINAL_CODES, ConnectionFailed, error_from_body

PIECE = 1 << 20  # bytes per readinto: a piece is hashed while it is still in L2
_RETRY_STATUS = frozenset({500, 502, 503, 504})


class _Retry(Exception):
    def __init__(self, err: BaseException) -> None:
        self.err = err


class HttpRowReader:
    """Rows of the MinT service at ``url``, read by the calling thread.

    Parameters
    ----------
    url
        The service, ``http(s)://host:port``.
    token
        Bearer token, if the service asks for one.
    timeout
        Longest silence on a connection (connect or read), in seconds.
    retries
        Extra attempts after a connection error or a retryable 5xx.
    """

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.05, max_backoff: float = 2.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s):// URL: {url!r}")
        if timeout <= 0 or retries < 0:
            raise ValueError("timeout must be positive and retries >= 0")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout, self.retries, self.backoff, self.max_backoff = timeout, retries, backoff, max_backoff
        self._local = threading.local()  # this thread's connection

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = self._local.conn = cls(self._host, self._port, timeout=self.timeout)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close this thread's connection (others close when their threads end)."""
        self._drop()

    def read_row(self, loc: Location, out: Any = None, *, verify: bool = True) -> Any:
        """Fill ``out`` (allocated if None) with the row of ``loc``, checked against its content
        id as it lands; returns ``out``.

        Raises
        ------
        IntegrityError
            The service sent the wrong number of bytes, or bytes that are not the content id's.
        ConnectionFailed
            No attempt got the whole row.
        MintError
            The service's typed error (``BlobNotFound``, ``Unauthorized``, ...).
        """
        out, view = row_buffer(loc.length, out)
        attempt = 0
        while True:
            try:
                self._attempt(loc, view, verify)
                return out
            except _Retry as r:
                self._drop()
                if attempt >= self.retries:
                    err = r.err
                    if isinstance(err, MintError):
                        raise err from None
                    raise ConnectionFailed(f"GET {self.url}/v1/blobs/{loc.content_id}: {err or type(err).__name__}") \
                        from err
            attempt += 1
            time.sleep(min(self.max_backoff, self.backoff * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0))

    def _attempt(self, loc: Location, view: memoryview, verify: bool) -> None:
        for stale_ok in (True, False):
            reused = getattr(self._local, "conn", None) is not None
            conn = self._connection()
            try:
                conn.request("GET", f"{self._prefix}/v1/blobs/{loc.content_id}", headers=self._headers)
                resp = conn.getresponse()
                break
            except (OSError, http.client.HTTPException) as e:
                self._drop()
                if not (reused and stale_ok):
                    raise _Retry(e) from None
                # a kept-alive connection the server closed while idle: sent again at once, on a new one
        try:
            if resp.status >= 400:
                raise self._failure(resp)  # (its body read: the connection stays usable)
            if resp.length != loc.length:
                raise IntegrityError(f"row {loc.content_id}: server sent {resp.length} bytes, expected {loc.length}")
            check = RowCheck(loc) if verify else None
            pos = 0
            while pos < loc.length:
                piece = view[pos : min(loc.length, pos + PIECE)]
                got = resp.readinto(piece)
                if not got:
                    raise _Retry(ConnectionFailed(f"row {loc.content_id} ended after {pos} bytes"))
                if check is not None:
                    check.update(piece[:got])  # one pass: hashed as it lands, while it is in cache
                pos += got
            if check is not None and not check.matches():
                raise IntegrityError(f"row received for content id {loc.content_id} does not match it")
        except (OSError, http.client.HTTPException) as e:
            self._drop()
            raise _Retry(e) from None
        except IntegrityError:
            self._drop()  # (the rest of a body that was not read)
            raise

    def _failure(self, resp: http.client.HTTPResponse) -> BaseException:
        try:
            payload = json.loads(resp.read())
        except (ValueError, OSError, http.client.HTTPException):
            payload = None
        err = error_from_body(resp.status, payload)
        if resp.status in _RETRY_STATUS and err.code not in TERMINAL_CODES:
            return _Retry(err)
        return err
