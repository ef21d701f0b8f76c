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
keep-alive connection per thread. :meth:`HttpRowReader.read_blob` reads a row knowing only its
content id (the answer's headers give the layout id and length the check needs), and
:meth:`HttpRowReader.resolve` is ``POST /v1/resolve`` of one ref: what vLLM's resolver and worker
ask on a cold load, each one request on the thread that asks (measured in vLLM's processes,
``tools/bench_vllm.py``, a hop to the client's event loop thread and back cost milliseconds on
a CPU vLLM's threads keep busy).
"""

from __future__ import annotations

import http.client
import json
import random
import re
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from mint_store import Location
from mint_store.errors import IntegrityError, MintError
from mint_store.format.adapter import AdapterLimits
from mint_store.format.names import check_content_id
from mint_store.read import RowCheck
from mint_store.read.buffers import row_buffer

from ..errors import TERMINAL_CODES, ConnectionFailed, error_from_body
from .thread_conns import ThreadConnections

MAX_ROW_BYTES = AdapterLimits().max_row_bytes  # no row is larger: a longer answer is refused before alloc
PIECE = 1 << 20  # bytes per readinto: a piece is hashed while it is still in L2
_HEX = re.compile(r"[0-9a-f]{16,128}")  # a layout id
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
        self._conns = ThreadConnections(self._connect)  # this thread's connection, every thread's for close()

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout)

    def close(self) -> None:
        """Close every thread's connection (a thread that reads again opens a new one)."""
        self._conns.close()  # (a thread's next request on its closed one reconnects)

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
        self._retrying(f"/v1/blobs/{loc.content_id}", lambda: self._attempt(loc.content_id, loc, view, verify))
        return out

    def read_blob(self, content_id: str, alloc: Callable[[int], Any]) -> tuple[Location, Any]:
        """The row of ``content_id`` in a buffer ``alloc(length)`` gives, with no resolve first: the
        answer's headers say its layout id and length, and the bytes are checked against the
        content id, which binds both (a wrong header fails the check). Returns ``(location,
        buffer)``; the location has no shard (the service reads rows by content id).

        Raises as :meth:`read_row`.
        """
        check_content_id(content_id)
        got: list[Any] = []
        bufs: dict[int, Any] = {}  # length -> the buffer alloc gave: a retry reuses it

        def once(n: int) -> Any:
            if n > MAX_ROW_BYTES:
                raise IntegrityError(f"row {content_id}: the service says {n} bytes, over any row ({MAX_ROW_BYTES})")
            if n not in bufs:
                bufs.clear()
                bufs[n] = alloc(n)
            return bufs[n]

        def attempt() -> None:
            got[:] = [self._attempt(content_id, None, once, True)]

        self._retrying(f"/v1/blobs/{content_id}", attempt)
        return got[0]

    def resolve(self, ref: str) -> Location:
        """``POST /v1/resolve`` of one ref, on this thread: its location, or its typed error."""
        body = self._json("POST", "/v1/resolve", json.dumps({"refs": [ref]}).encode())
        try:
            (item,) = body["results"]
        except (KeyError, TypeError, ValueError):
            raise IntegrityError(f"POST {self.url}/v1/resolve: not one result for one ref") from None
        if not isinstance(item, dict) or "location" not in item:
            raise error_from_body(404, item)
        return Location(**item["location"])

    def local_socket(self) -> dict[str, Any]:
        """``GET /v1/local-socket``: the service's socket on its machine (``path``), the
        ``instance`` id it answers there and the ``uid`` it runs as; ``NotFound`` when it has none."""
        body = self._json("GET", "/v1/local-socket")
        if not isinstance(body, dict) or not isinstance(body.get("path"), str) \
                or not isinstance(body.get("instance"), str) or not isinstance(body.get("uid"), int):
            raise IntegrityError(f"GET {self.url}/v1/local-socket: no path, instance and uid")
        return body

    def _json(self, method: str, path: str, data: bytes | None = None) -> Any:
        """The JSON body of ``method path`` (retried as a read), or the service's typed error."""
        got: list[Any] = []

        def attempt() -> None:
            resp = self._send(method, path, data)
            try:
                if resp.status >= 400:
                    raise self._failure(resp)
                body = json.loads(resp.read())
            except MintError:
                raise  # the service's typed answer (a 401 is a PermissionError, an OSError): never retried
            except (OSError, http.client.HTTPException) as e:
                self._conns.drop()
                raise _Retry(e) from None
            except ValueError as e:
                self._conns.drop()
                raise IntegrityError(f"{method} {self.url}{path} answered no JSON ({e})") from None
            got[:] = [body]

        self._retrying(path, attempt)
        return got[0]

    def _retrying(self, path: str, attempt: Callable[[], None]) -> None:
        tries = 0
        while True:
            try:
                attempt()
                return
            except _Retry as r:
                self._conns.drop()
                if tries >= self.retries:
                    err = r.err
                    if isinstance(err, MintError):
                        raise err from None
                    raise ConnectionFailed(f"{self.url}{path}: {err or type(err).__name__}") from err
            tries += 1
            time.sleep(min(self.max_backoff, self.backoff * 2 ** (tries - 1)) * random.uniform(0.5, 1.0))

    def _send(self, method: str, path: str, body: bytes | None = None) -> http.client.HTTPResponse:
        headers = self._headers if body is None else self._headers | {"Content-Type": "application/json"}
        for stale_ok in (True, False):
            reused = self._conns.held
            conn = self._conns.get()
            try:
                conn.request(method, f"{self._prefix}{path}", body=body, headers=headers)
                return conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                self._conns.drop()
                if not (reused and stale_ok):
                    raise _Retry(e) from None
                # a kept-alive connection the server closed while idle: sent again at once, on a new one
        raise AssertionError("unreachable")

    def _attempt(self, content_id: str, loc: Location | None, into: Any, verify: bool) -> Any:
        resp = self._send("GET", f"/v1/blobs/{content_id}")
        try:
            if resp.status >= 400:
                raise self._failure(resp)  # (its body read: the connection stays usable)
            out = None
            if loc is None:  # read by content id: the answer says the rest
                layout_id = resp.getheader("X-Mint-Layout-Id") or ""
                if resp.length is None or not _HEX.fullmatch(layout_id):
                    raise IntegrityError(f"row {content_id}: the service sent no length or layout id")
                loc = Location(content_id, layout_id, "", 0, resp.length, 0)
                out, view = row_buffer(loc.length, into(loc.length))
            else:
                view = into
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
            return loc, out
        except IntegrityError:
            self._conns.drop()  # (the rest of a body that was not read)
            raise
        except MintError:
            raise  # the service's typed answer, its body read (a 401 is a PermissionError, an OSError): not retried
        except (OSError, http.client.HTTPException) as e:
            self._conns.drop()
            raise _Retry(e) from None
        except BaseException:
            self._conns.drop()  # (e.g. alloc failed: the body is still on the connection)
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
