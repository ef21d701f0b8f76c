"""A row copied by the MinT service on this machine straight into the caller's memory.

The client side of :mod:`mint_store.service.local_copy` (its docstring has the protocol): the
caller's buffer is a memfd mapping (:mod:`engine_client.vllm_plugin.buffers` makes its buffers
so); its descriptor goes to the service over a Unix socket, the service has the kernel copy the
row into it from the shard file, and each piece is hashed here as the service reports it, while
the next piece is copied. Same semantics as :meth:`.http_rows.HttpRowReader.read_blob`: a row
by content id with no resolve first, every byte checked against the content id, the service's
typed errors. A socket that is not there, refuses, or breaks is a :class:`ConnectionFailed`
(the caller reads over HTTP instead). One connection per thread, kept between reads.
:func:`find_local_socket` finds the socket of a service named by its URL, where it is on this
machine.
"""

from __future__ import annotations

import array
import os
import re
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mint_store import Location
from mint_store.errors import IntegrityError, MintError, NotFound
from mint_store.format import frames
from mint_store.format.names import check_content_id
from mint_store.format.wire import BadRequest, RouteNotFound, ServiceUnavailable, error_from_body
from mint_store.read import RowCheck

from ..errors import ConnectionFailed
from .http_rows import MAX_ROW_BYTES, HttpRowReader
from .thread_conns import ThreadConnections

_HEX = re.compile(r"[0-9a-f]{16,128}")
HELLO_TIMEOUT_S = 2.0  # longest find_local_socket waits for whatever answers at the path named
Alloc = Callable[[int], tuple[Any, int]]  # length -> (a writable buffer of it, the memfd that maps it)


class LocalRowReader:
    """Rows of the MinT service listening on the Unix socket ``path`` (``mint serve --local-socket``).

    Parameters
    ----------
    path
        The service's socket.
    token
        Bearer token, if the service asks for one (the same as over HTTP).
    timeout
        Longest silence of the service, in seconds.
    """

    def __init__(self, path: str | Path, token: str | None = None, *, timeout: float = 60.0) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.path, self.token, self.timeout = str(path), token, timeout
        self.resolves = True  # the service resolves refs on its socket (False: an older one, which does not)
        self._conns = ThreadConnections(self._connect)  # this thread's, kept between reads

    def read_blob(self, content_id: str, alloc: Alloc) -> tuple[Location, Any]:
        """The row of ``content_id``, copied into the buffer ``alloc(length)`` gives, checked against
        the content id. Returns ``(location, buffer)``; the location has no shard.

        Raises
        ------
        ConnectionFailed
            No socket, or it broke: nothing was read (read over HTTP instead).
        IntegrityError
            The bytes copied are not the content id's.
        MintError
            The service's typed error (``BlobNotFound``, ``Unauthorized``, ...).
        """
        check_content_id(content_id)
        return self._call(lambda conn: self._read(conn, content_id, alloc))

    def resolve(self, ref: str) -> Location | None:
        """``POST /v1/resolve`` of one ref, asked on the socket (no HTTP): its location as the
        service shows it to this token (a tenant's: no shard), or its typed error. None where
        the service cannot resolve on its socket (an older one): ask over HTTP, as from now on.

        Raises
        ------
        ConnectionFailed
            No socket, or it broke (ask over HTTP instead).
        MintError
            The service's typed error (``NotFound``, ``Forbidden``, ``Unauthorized``, ...).
        """
        if not self.resolves:
            return None

        def ask(conn: socket.socket) -> Location | None:
            conn.sendall(frames.pack({"v": 1, "token": self.token, "resolve": ref}))
            try:
                got = _reply(conn)
            except BadRequest as e:  # (an older service takes it for a read without a content id)
                if "content_id" not in str(e):
                    raise
                self.resolves = False
                return None
            where = got.get("location")
            if not isinstance(where, dict):
                raise IntegrityError(f"local copy socket {self.path}: no location for {ref!r}")
            try:
                return Location(**where)
            except TypeError as e:
                raise IntegrityError(f"local copy socket {self.path}: a location that is not one ({e})") from None

        return self._call(ask)

    def _call(self, exchange: Callable[[socket.socket], Any]) -> Any:
        """``exchange`` on this thread's connection: a kept one the service closed while idle is
        replaced once; a socket that breaks is a ConnectionFailed."""
        for fresh in (False, True):  # a kept connection the service closed while idle: once more, on a new one
            reused = self._conns.held and not fresh
            conn = self._conns.get()
            try:
                return exchange(conn)
            except ServiceUnavailable as e:  # (all its connections taken: HTTP, as for a socket that is not there)
                self._conns.drop()
                raise ConnectionFailed(f"local copy socket {self.path}: {e}") from None
            except MintError:  # the service's answer (Unauthorized is an OSError too): not a broken socket
                self._conns.drop()
                raise
            except (OSError, EOFError) as e:
                self._conns.drop()
                if not reused:
                    raise ConnectionFailed(f"local copy socket {self.path}: {e or type(e).__name__}") from None
            except BaseException:
                self._conns.drop()  # (a half-done exchange: the connection's state is unknown)
                raise
        raise AssertionError("unreachable")

    def peer_uid(self) -> int:
        """The user id of the process that listens at this socket (``SO_PEERCRED``)."""
        conn = self._conns.get()
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError as e:
            self._conns.drop()
            raise ConnectionFailed(f"local copy socket {self.path}: {e}") from None
        return int(struct.unpack("3i", creds)[1])  # (pid, uid, gid)

    def hello(self) -> str:
        """The ``instance`` id of the service at this socket (``GET /v1/local-socket`` names it too).

        Raises
        ------
        ConnectionFailed
            No socket there, or it broke.
        MintError
            Whatever answers there is no MinT service that says hello (its error, as typed).
        """
        def ask(conn: socket.socket) -> str:
            conn.sendall(frames.pack({"v": 1, "hello": True}))
            got = _reply(conn).get("instance")
            if not isinstance(got, str):
                raise IntegrityError(f"local copy socket {self.path}: hello answered no instance")
            return got

        return str(self._call(ask))

    def keep(self, fd: int) -> bool:
        """Show the service the buffer (a sealed memfd, ``fd``) a later row will be copied into:
        it maps it now, so that copy is a ``pread`` into a mapping, not a write through the
        memfd. Whether the service kept it (an older service refuses: a ``BadRequest``).

        Raises
        ------
        ConnectionFailed
            No socket there, or it broke.
        MintError
            The service's typed error (``Unauthorized``, ...).
        """
        def show(conn: socket.socket) -> bool:
            conn.sendall(frames.pack({"v": 1, "token": self.token, "keep": True}))
            _reply(conn)  # {"ready": true}
            conn.sendmsg([frames.pack({"into": True})],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            return _reply(conn).get("kept") is True

        return bool(self._call(show))

    def _read(self, conn: socket.socket, content_id: str, alloc: Alloc) -> tuple[Location, Any]:
        conn.sendall(frames.pack({"v": 1, "token": self.token, "content_id": content_id}))
        head = _reply(conn)
        length, layout_id = head.get("length"), head.get("layout_id")
        if not isinstance(length, int) or not 0 < length <= MAX_ROW_BYTES or not isinstance(layout_id, str) \
                or not _HEX.fullmatch(layout_id):
            raise IntegrityError(f"row {content_id}: the service sent no valid length or layout id")
        loc = Location(content_id, layout_id, "", 0, length, 0)
        try:
            out, fd = alloc(length)
        except BaseException:
            conn.sendall(frames.pack({"into": False}))  # (the service waits for the descriptor: it is not coming)
            raise
        view = memoryview(out).cast("B")[:length]
        conn.sendmsg([frames.pack({"into": True})], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        check, pos = RowCheck(loc), 0
        while True:
            msg = _reply(conn)
            done = msg.get("done")
            if not isinstance(done, int) or not pos <= done <= length:
                raise IntegrityError(f"row {content_id}: the service reported {done!r} of {length} bytes")
            check.update(view[pos:done])  # hashed while the service copies the next piece
            pos = done
            if msg.get("end"):
                break
        if pos != length or not check.matches():
            raise IntegrityError(f"row copied for content id {content_id} does not match it")
        return loc, out

    def _connect(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(self.timeout)
        try:
            conn.connect(self.path)
        except OSError as e:
            conn.close()
            raise ConnectionFailed(f"local copy socket {self.path}: {e}") from None
        return conn

    def close(self) -> None:
        """Close every thread's connection (a thread that reads again opens a new one)."""
        self._conns.close()


def _reply(conn: socket.socket) -> dict[str, Any]:
    """The service's next frame: a map, or its typed error raised."""
    try:
        msg = frames.unpack(frames.recv_exact(conn, frames.size_of(frames.recv_exact(conn, frames.HEAD.size))))
    except ValueError as e:
        raise IntegrityError(f"the local copy socket sent no valid frame ({e})") from None
    if not isinstance(msg, dict):
        raise IntegrityError("the local copy socket sent a frame that is not a map")
    if "error" in msg:
        status = msg.get("status")
        err: MintError = error_from_body(status if isinstance(status, int) else 500, msg)
        raise err
    return msg


def find_local_socket(http: HttpRowReader, token: str | None = None) -> LocalRowReader | None:
    """The socket of the service ``http`` reads from, where it is on this machine; else None.

    Asks the service where its socket is (``GET /v1/local-socket``), and takes the socket at that
    path only if the process answering there runs as the service's user and says hello with the
    service's instance id: a client on another machine, or in a container with a ``/run`` of its
    own, may find some other service's socket at that path (or none), and the token is sent only
    to the service itself.

    Raises
    ------
    MintError
        The service could not be asked now (``ConnectionFailed``, its typed error): ask again later.
    """
    try:
        info = http.local_socket()
    except (NotFound, RouteNotFound):
        return None  # (a service started without --local-socket, or one older than the route)
    path = info["path"]
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return None
    except OSError:
        return None  # (not on this machine, or not in this mount namespace)
    probe = LocalRowReader(path, timeout=HELLO_TIMEOUT_S)  # (no token: to whatever answers there)
    try:
        same = probe.peer_uid() == info["uid"] and probe.hello() == info["instance"]
    except MintError:  # (a socket of something else, one that broke, or a service older than hello)
        same = False
    finally:
        probe.close()
    return LocalRowReader(path, token) if same else None
