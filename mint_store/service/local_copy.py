"""Rows copied straight into a caller's memory on this machine: one kernel copy, no byte stream.

Over loopback HTTP a row crosses the kernel twice (page cache -> socket buffers -> the
reader's memory) with the TCP stack between: on the 2-core VM of ``tools/bench_vllm.py`` a
37 MB row took 21-25 ms that way, a ``pread`` of the same bytes 5-6 ms. A client on this
machine (vLLM's worker: :mod:`engine_client.client.local_rows`) can instead hand the service
the memory it wants the row in, a memfd (any regular file it may write), over a Unix socket
(``SCM_RIGHTS``). The service answers it as ``GET /v1/blobs/{content id}``: the same token
check, the same tenant filter, the same check of the row's place and bytes
(:mod:`.rows.checks`); then the kernel copies the row from the shard file into that memory, and
each piece is reported as it lands, so the client hashes it while the next is copied. The copy
is a ``pread`` into the service's kept mapping of a memfd sealed against shrinking, which the
caller sends again for its next row (:mod:`.copy_targets`); into anything else (and into such
a memfd the first time), ``sendfile``. The client checks every byte against the content id,
as over HTTP.

Why not pass the shard's descriptor instead (HDFS's short-circuit reads): a pack holds
other rows, other tenants' among them; the service writes only the bytes this token may read.

Protocol: frames of a 4-byte big-endian length and a msgpack map (:mod:`..format.frames`), any
number of requests on one connection::

    client: {"v": 1, "token": str | None, "content_id": str}
    server: {"length": n, "layout_id": str}             or an error frame
    client: {"into": true}, the descriptor as SCM_RIGHTS  (or {"into": false}: not wanted)
    server: {"done": k} ... {"done": n, "end": true}     or an error frame
    error frame: {"error": code, "message": str, "status": HTTP status}

    client: {"v": 1, "hello": true}                       (which service is this?)
    server: {"instance": str}

    client: {"v": 1, "token": str | None, "resolve": ref}  (POST /v1/resolve of one ref)
    server: {"ref": ref, "location": {...}}              or {"ref": ref, "error": code, "message": str}
                                                          (the ref's own answer); or an error frame

    client: {"v": 1, "token": str | None, "keep": true}   (a buffer for a later row: map it now)
    server: {"ready": true}                               or an error frame
    client: {"into": true}, the descriptor as SCM_RIGHTS
    server: {"kept": bool}                                (:meth:`.copy_targets.CopyTargets.prepare`)

A client finds the socket itself: ``GET /v1/local-socket`` names its path and the server's
``instance``, a random id drawn at start; the socket's ``hello`` answers the same id only if
it is that server's. The path may name another service's socket on the client's machine (a
client on another host, a container with its own ``/run``); the id tells them apart.

Each connection has a thread of its own; at most ``MAX_CONNECTIONS`` at once (more get a
503 frame and are closed), each silent for at most ``read_timeout`` while a request is under
way and ``idle_timeout`` between requests: no client can make the service unresponsive.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import logging
import os
import secrets
import socket
import stat
import threading
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from .. import errors as E
from ..format import frames
from ..format.names import check_content_id
from ..results import Location
from .auth import LOOPBACK_ADMIN, Principal, TokenTable
from .copy_targets import CopyTargets, Mapped
from .errors import BadRequest, ServiceUnavailable, error_body, status_for
from .ref_answers import answers, screen
from .rows.checks import check_location
from .rows.serving import SENDFILE_PIECE, RowSender

MAX_CONNECTIONS = 64
MAX_REF = 1024  # characters of a ref to resolve (a valid one is ~200)
log = logging.getLogger("mint_store.service.local_copy")


class LocalCopyServer:
    """The Unix socket at ``path``, answered by threads of its own (start, stop)."""

    def __init__(self, path: str | os.PathLike[str], store: Any, rows: RowSender, tokens: TokenTable | None, *,
                 read_timeout: float = 30.0, idle_timeout: float = 75.0, map_bytes: int = 2 << 30) -> None:
        self.path = Path(path).absolute()
        self.instance = secrets.token_hex(16)  # which server answers at path (hello; GET /v1/local-socket)
        self.targets = CopyTargets(map_bytes)  # callers' buffers kept mapped between their rows
        self.store, self.rows, self.tokens = store, rows, tokens
        self.read_timeout, self.idle_timeout = read_timeout, idle_timeout
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self.copies = 0  # rows copied (tests and logs)
        self.resolves = 0  # refs resolved on the socket (tests and logs)

    def start(self) -> None:
        """Bind the socket (a stale socket file of a stopped server is replaced) and serve."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(self.path.lstat().st_mode):
                self.path.unlink()  # (anything else at the path: bind fails, naming it)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(str(self.path))
            # who may connect is who may reach the loopback port: the token decides what they read
            os.chmod(self.path, 0o666)
            s.listen(128)
        except BaseException:
            s.close()
            raise
        self._listener = s
        self._thread = threading.Thread(target=self._accept, name="mint-local-copy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        s, self._listener = self._listener, None
        if s is not None:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            conns = list(self._conns)
            threads = list(self._threads)
        for c in conns:  # (their threads see the connection end and return)
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in threads:  # a copy under way finishes before the store closes
            t.join(timeout=5)
        self.targets.clear()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _accept(self) -> None:
        while self._listener is not None:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed: stopping
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                with contextlib.suppress(OSError):
                    conn.settimeout(1.0)
                    _send(conn, _error(ServiceUnavailable(
                        f"{MAX_CONNECTIONS} local copy connections are open; try again, or read over HTTP")))
                conn.close()
                continue
            t = threading.Thread(target=self._serve, args=(conn,), name="mint-local-copy-conn", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                conn.settimeout(self.idle_timeout)
                try:
                    request = _recv(conn)
                except (OSError, EOFError):
                    return
                except E.MintError as e:  # a frame that does not parse: answered, then the connection ends
                    _send(conn, _error(e))
                    return
                if request is None:
                    return  # the client closed the connection between requests
                conn.settimeout(self.read_timeout)
                if not self._answer(conn, request):
                    return
        except Exception:  # a bug: this connection ends, the service goes on
            log.exception("local copy connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
                last = not self._conns
            if last:  # no caller left: none of their buffers stays mapped
                self.targets.clear()
            conn.close()

    def _answer(self, conn: socket.socket, request: Any) -> bool:
        """One request; False when the connection cannot go on."""
        if isinstance(request, dict) and request.get("v") == 1 and request.get("hello") is True:
            return _send(conn, {"instance": self.instance})
        if isinstance(request, dict) and request.get("v") == 1 and request.get("keep") is True:
            return self._keep(conn, request)
        if isinstance(request, dict) and request.get("v") == 1 and "resolve" in request:
            return self._resolve(conn, request)
        try:
            loc, owners = self._locate(request)
        except (E.MintError, ValueError) as e:
            return _send(conn, _error(e if isinstance(e, E.MintError) else BadRequest(str(e))))
        if not _send(conn, {"length": loc.length, "layout_id": loc.layout_id}):
            return False
        try:
            msg, fds = _recv_fd(conn)
        except (OSError, EOFError, E.MintError):
            return False
        into = msg.get("into") if isinstance(msg, dict) else None
        if into is not True or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            if into is False:
                return True  # the client wanted it no more: its next request may follow
            _send(conn, _error(BadRequest("send {'into': true} with exactly one file descriptor")))
            return False
        try:
            try:
                mapped = self._copy(conn, loc, owners, fds[0])
            except (E.MintError, ValueError, OSError) as e:
                err = e if isinstance(e, E.MintError) else BadRequest(f"could not write into the descriptor sent: {e}")
                if isinstance(e, E.IntegrityError):
                    log.error("local copy of %s refused: %s", loc.content_id, e)
                return _send(conn, _error(err))
            with self._lock:
                self.copies += 1  # (before the client hears the end: it may count them at once)
            ok = _send(conn, {"done": loc.length, "end": True})
            if not mapped:  # the caller has its row: map its buffer for the next one (if it may be)
                self.targets.keep(fds[0], loc.length)
            return ok
        finally:
            os.close(fds[0])

    def _keep(self, conn: socket.socket, request: dict[str, Any]) -> bool:
        """A caller's buffer, sent before the row it is for: mapped now (``keep`` in the protocol)."""
        try:
            self._owners(request.get("token"))  # (only a token that may read: the mapping is of the service's memory)
        except E.MintError as e:
            return _send(conn, _error(e))
        if not _send(conn, {"ready": True}):
            return False
        try:
            msg, fds = _recv_fd(conn)
        except (OSError, EOFError, E.MintError):
            return False
        try:
            if not isinstance(msg, dict) or msg.get("into") is not True or len(fds) != 1:
                _send(conn, _error(BadRequest("send {'into': true} with exactly one file descriptor")))
                return False
            return _send(conn, {"kept": self.targets.prepare(fds[0])})
        finally:
            for fd in fds:
                os.close(fd)

    def _resolve(self, conn: socket.socket, request: dict[str, Any]) -> bool:
        """One ref resolved as ``POST /v1/resolve`` resolves it (:mod:`.ref_answers`: the same
        refusals, the same location a token may see), without HTTP: the plugin's resolver asks
        here before vLLM's worker reads the row (docs/service.md has the numbers)."""
        ref = request.get("resolve")
        try:
            who = self._principal(request.get("token"))
            if not isinstance(ref, str) or not 0 < len(ref) <= MAX_REF:
                raise BadRequest(f"resolve takes one ref of 1 to {MAX_REF} characters")
        except E.MintError as e:
            return _send(conn, _error(e))
        with self._lock:
            self.resolves += 1
        screened, allowed = screen([ref], who)
        try:
            found = self.store.resolve_many(allowed, owners=who.owner_filter())
        except E.MintError as e:  # (the lookup as a whole failed: its typed error, as HTTP answers it)
            return _send(conn, _error(e))
        (answer,) = answers([ref], screened, found, who)
        return _send(conn, answer)  # {"ref", "location"}, or {"ref", "error", "message"}

    def _principal(self, token: Any) -> Principal:
        """Who ``token`` is (Unauthorized if it is not a token here); without a token file, the
        loopback admin: a server without tokens serves this machine's clients, all of them."""
        if self.tokens is None:
            return LOOPBACK_ADMIN
        return self.tokens.authenticate(f"Bearer {token}" if isinstance(token, str) else None)

    def _owners(self, token: Any) -> frozenset[str] | None:
        """The tenants ``token`` may read (None: all); Unauthorized if it is not a token here."""
        return self._principal(token).owner_filter()

    def _locate(self, request: Any) -> tuple[Location, frozenset[str] | None]:
        if not isinstance(request, dict) or request.get("v") != 1:
            raise BadRequest("expected {'v': 1, 'token': ..., 'content_id': ...}")
        owners = self._owners(request.get("token"))
        content_id = request.get("content_id")
        if not isinstance(content_id, str):
            raise BadRequest("content_id must be a string")
        (got,) = self.store.resolve_many([f"sha:{check_content_id(content_id)}"], owners=owners)
        if isinstance(got, E.MintError):
            raise got
        return got, owners

    def _copy(self, conn: socket.socket, loc: Location, owners: frozenset[str] | None, dst: int) -> bool:
        """Copy the row into ``dst``; whether through a kept mapping of it."""
        st = os.fstat(dst)
        if not stat.S_ISREG(st.st_mode) or fcntl.fcntl(dst, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise BadRequest("the descriptor must be a memfd or regular file open for writing")
        if st.st_size < loc.length:
            raise BadRequest(f"the memory sent holds {st.st_size} bytes; the row is {loc.length}")
        try:
            return self._copy_at(conn, loc, dst)
        except E.StaleLocation:  # compaction moved the row since it was resolved: where it is now
            (again,) = self.store.resolve_many([f"sha:{loc.content_id}"], owners=owners)
            if isinstance(again, E.MintError):
                raise again from None
            return self._copy_at(conn, again, dst)

    def _copy_at(self, conn: socket.socket, loc: Location, dst: int) -> bool:
        check_location(loc)  # never a read outside the pack the index names
        mapped = self.targets.take(dst, loc.length)  # None: through dst's file interface
        try:
            if self.rows.local_storage is None:
                self._copy_checked(loc, dst, mapped)
            else:
                self._copy_from_shard(conn, loc, dst, mapped)
        finally:
            if mapped is not None:
                self.targets.give_back(mapped)
        self.rows.on_bytes("local_copy", loc.length)
        return mapped is not None

    def _copy_checked(self, loc: Location, dst: int, mapped: Mapped | None) -> None:
        """An object store: its checked bytes, read into the caller's memory (or written to it)."""
        if mapped is not None:
            self.store.read_row(loc, np.frombuffer(mapped.mm, dtype=np.uint8, count=loc.length))  # (verified)
            return
        row = bytearray(loc.length)
        self.store.read_row(loc, np.frombuffer(row, dtype=np.uint8))  # (verified)
        view, done = memoryview(row), 0
        while done < loc.length:
            done += os.pwrite(dst, view[done:], done)

    def _copy_from_shard(self, conn: socket.socket, loc: Location, dst: int, mapped: Mapped | None) -> None:
        f = self.rows.open_checked(loc)  # as GET: hashed once per shard file, or known
        try:
            if mapped is None:
                os.lseek(dst, 0, os.SEEK_SET)  # (sendfile writes at dst's own offset)
            done = 0
            with memoryview(mapped.mm) if mapped is not None else contextlib.nullcontext() as into:
                while done < loc.length:
                    k = min(SENDFILE_PIECE, loc.length - done)
                    if into is not None:
                        with into[done:done + k] as piece:
                            n = os.preadv(f.fileno(), [piece], loc.offset + done)
                    else:
                        n = os.sendfile(dst, f.fileno(), loc.offset + done, k)
                    if n == 0:
                        raise E.IntegrityError(f"{loc.shard_key} is shorter than the row the index places in it")
                    done += n
                    if done < loc.length and not _send(conn, {"done": done}):
                        raise OSError("the client went away")
        finally:
            self.rows.release(f)


def _error(err: BaseException) -> dict[str, Any]:
    return error_body(err) | {"status": status_for(err)}


def _send(conn: socket.socket, msg: dict[str, Any]) -> bool:
    try:
        conn.sendall(frames.pack(msg))
        return True
    except OSError:
        return False


def _recv(conn: socket.socket) -> Any:
    """The next frame's map; None if the connection closed before one began."""
    head = conn.recv(frames.HEAD.size)
    if not head:
        return None
    if len(head) < frames.HEAD.size:
        head += frames.recv_exact(conn, frames.HEAD.size - len(head))
    return _decode(frames.recv_exact(conn, _size(head)))


def _recv_fd(conn: socket.socket) -> tuple[Any, list[int]]:
    """A frame that may carry descriptors: the first recvmsg takes them with the frame's head."""
    data, anc, _, _ = conn.recvmsg(frames.MAX_FRAME + frames.HEAD.size, socket.CMSG_SPACE(4 * 4))
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    try:
        if not data:
            raise EOFError("connection closed")
        if len(data) < frames.HEAD.size:
            data += frames.recv_exact(conn, frames.HEAD.size - len(data))
        n = _size(data[: frames.HEAD.size])
        body = data[frames.HEAD.size:]
        if len(body) < n:
            body += frames.recv_exact(conn, n - len(body))
        return _decode(body), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _size(head: bytes) -> int:
    try:
        return frames.size_of(head)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def _decode(body: bytes) -> Any:
    try:
        return frames.unpack(body)
    except ValueError as e:
        raise BadRequest(str(e)) from None


LOCAL_COPY = web.AppKey("mint_local_copy", LocalCopyServer)  # the running server, when local_socket is set
