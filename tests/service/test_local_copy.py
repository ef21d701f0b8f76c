"""The service's Unix socket for clients on this machine (mint_store.service.local_copy) and its
client (engine_client.client.local_rows): the row copied into the caller's memfd is the row
GET /v1/blobs serves, under the same token and tenant checks, every byte checked by the client."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from engine_client import MintClient
from engine_client.client.http_rows import HttpRowReader
from engine_client.client.local_rows import LocalRowReader
from engine_client.errors import ConnectionFailed, IntegrityError
from engine_client.vllm_plugin.buffers import RowBuffers
from mint_store import Location
from mint_store.errors import BlobNotFound, NotFound
from mint_store.format.wire import BadRequest
from mint_store.service.local_copy import LOCAL_COPY
from mint_store.service.rows.serving import SENDFILE_PIECE
from mint_store.storage import LocalStorage
from tests.support.factories import random_adapter
from tests.support.service import TOKENS, ServerFactory
from tests.support.targets import StoreTarget

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux's")


def _memfd(n: int) -> tuple[np.ndarray, int]:
    fd = os.memfd_create("test-row")
    os.ftruncate(fd, n)
    import mmap

    return np.frombuffer(mmap.mmap(fd, n), dtype=np.uint8), fd


async def _published(server_url: str, token: str | None, n: int, **shape: int) -> list[Location]:
    async with MintClient(server_url, token=token) as c:
        return [await c.resolve(f"sha:{(await c.publish('acme', f'x{i}', random_adapter(i, **shape))).content_id}")
                for i in range(n)]


async def _one_row(make_server: ServerFactory, target: StoreTarget, tmp_path: Path) -> tuple[Any, Path, Location]:
    """A server with its socket, holding one small row."""
    sock = tmp_path / "mint.sock"
    server = await make_server(target, local_socket=str(sock))
    (loc,) = await _published(server.url, None, 1, rank=8)
    return server, sock, loc


async def test_rows_are_copied_into_the_callers_memory_as_get_serves_them(
        make_server: ServerFactory, target: StoreTarget, tmp_path: Path) -> None:
    """Local packs (sendfile from the shard) and S3 (the checked row read into the caller's memory)."""
    sock = tmp_path / "mint.sock"
    server = await make_server(target, local_socket=str(sock))
    locs = await _published(server.url, None, 2, rank=64, layers=4, hidden=1024)
    assert locs[0].length > 2 * SENDFILE_PIECE  # copied in several pieces, each hashed as reported
    async with MintClient(server.url) as c:
        want = [bytes(await c.read_row(loc)) for loc in locs]
    reader = LocalRowReader(sock)
    pool = RowBuffers(1 << 30)

    def read_all() -> list[bytes]:
        out = []
        for loc in locs * 2:  # one kept connection, one row after another
            got, _ = reader.read_blob(loc.content_id, lambda n: _shared(pool, n, held))
            assert (got.content_id, got.layout_id, got.length) == (loc.content_id, loc.layout_id, loc.length)
            out.append(held[-1].numpy().tobytes())
        return out

    held: list = []
    assert await asyncio.to_thread(read_all) == want * 2
    assert server.app[LOCAL_COPY].copies == 4
    assert len(reader._conns) == 1
    reader.close()


async def test_a_buffer_sent_again_gets_its_next_row_through_the_mapping_kept_for_it(
        make_server: ServerFactory, target: StoreTarget, tmp_path: Path) -> None:
    """A worker's pooled buffers (sealed memfds) are mapped once by the service, and each row
    copied into one is still exactly the row GET serves; an unsealed memfd is never mapped."""
    sock = tmp_path / "mint.sock"
    server = await make_server(target, local_socket=str(sock))
    locs = await _published(server.url, None, 2, rank=64, layers=4, hidden=1024)
    async with MintClient(server.url) as c:
        want = [bytes(await c.read_row(loc)) for loc in locs]
    reader = LocalRowReader(sock)
    buf, fd = RowBuffers(1 << 30).take_shared(max(loc.length for loc in locs))
    loose, loose_fd = _memfd(buf.numel())

    def read(loc: Location, into: tuple[np.ndarray, int]) -> bytes:
        reader.read_blob(loc.content_id, lambda n: into)
        return into[0][: loc.length].tobytes()

    for loc, row in zip(locs * 2, want * 2, strict=True):  # rows one after another into one buffer
        assert await asyncio.to_thread(read, loc, (buf.numpy(), fd)) == row
    targets = server.app[LOCAL_COPY].targets
    assert (targets.mapped, targets.reused) == (1, 3)  # (mapped after the first copy, for the next)
    assert await asyncio.to_thread(read, locs[1], (loose, loose_fd)) == want[1]
    assert targets.mapped == 1  # (it could shrink under a mapping)
    os.close(loose_fd)
    reader.close()
    # no client connected: the service keeps none of their memory mapped
    for _ in range(500):
        if targets.kept_bytes == 0:
            break
        await asyncio.sleep(0.01)
    assert targets.kept_bytes == 0


async def test_a_buffer_shown_before_its_first_row_is_mapped_then_and_that_row_is_exact(
        make_server: ServerFactory, local_target: StoreTarget, tmp_path: Path, tokens_file: str) -> None:
    """``keep``: a worker's spare (a sealed memfd it has touched) mapped before any row is copied
    into it, so even its first row goes through the mapping; only for a token that may read, and
    never for memory that could shrink under the mapping."""
    sock = tmp_path / "mint.sock"
    server = await make_server(local_target, local_socket=str(sock), tokens_file=tokens_file)
    (loc,) = await _published(server.url, TOKENS["acme"], 1, rank=64, layers=4, hidden=1024)
    async with MintClient(server.url, token=TOKENS["acme-read"]) as c:
        want = bytes(await c.read_row(loc))
    targets = server.app[LOCAL_COPY].targets
    pool = RowBuffers(1 << 30)
    buf, fd = pool.take_shared(loc.length)
    _loose, loose_fd = _memfd(loc.length)
    with pytest.raises(PermissionError, match="unknown token"):
        await asyncio.to_thread(LocalRowReader(sock, "x" * 20).keep, fd)
    reader = LocalRowReader(sock, TOKENS["acme-read"])
    assert await asyncio.to_thread(reader.keep, loose_fd) is False  # (unsealed: written through its fd)
    # (sealed, but pages never touched: mapping it ahead would have the service allocate them)
    assert await asyncio.to_thread(reader.keep, fd) is False
    small, small_fd = pool.take_shared(4096)  # (sealed? a small row's memfd is not pooled, so not sealed)
    small.numpy()[:] = 1
    assert await asyncio.to_thread(reader.keep, small_fd) is False
    assert (targets.mapped, targets.prepared) == (0, 0)
    for at in range(0, os.fstat(fd).st_size, 4096):  # every page touched, as the pool's spare thread does
        os.pwrite(fd, b"\0", at)
    assert await asyncio.to_thread(reader.keep, fd) is True
    assert await asyncio.to_thread(reader.keep, fd) is True  # (mapped already: not again)
    assert (targets.mapped, targets.prepared, targets.reused) == (1, 1, 0)
    await asyncio.to_thread(reader.read_blob, loc.content_id, lambda n: (buf.numpy(), fd))
    assert buf.numpy()[: loc.length].tobytes() == want
    assert (targets.mapped, targets.reused) == (1, 1)  # the first row into it: through the mapping
    os.close(loose_fd)
    reader.close()


def _shared(pool: RowBuffers, n: int, held: list) -> tuple[np.ndarray, int]:
    t, fd = pool.take_shared(n)
    held.append(t)
    return t.numpy(), fd


async def test_the_service_names_its_socket_and_the_id_the_socket_says_hello_with(
        make_server: ServerFactory, local_target: StoreTarget, tmp_path: Path, tokens_file: str) -> None:
    sock = tmp_path / "mint.sock"
    one = await make_server(local_target, local_socket=str(sock), tokens_file=tokens_file)
    reader = HttpRowReader(one.url, TOKENS["acme-read"])
    got = await asyncio.to_thread(reader.local_socket)
    assert got == {"path": str(sock.absolute()), "instance": one.app[LOCAL_COPY].instance, "uid": os.getuid()}
    assert await asyncio.to_thread(LocalRowReader(got["path"]).hello) == got["instance"]  # (hello needs no token)
    with pytest.raises(PermissionError, match="missing bearer token"):  # the route is a reader's, as blobs are
        await asyncio.to_thread(HttpRowReader(one.url).local_socket)
    # another server (another store) with a socket: another instance id, which tells them apart
    again = await make_server(StoreTarget("local", str(tmp_path / "s2"), str(tmp_path / "i2"), None),
                              local_socket=str(tmp_path / "again.sock"))
    assert again.app[LOCAL_COPY].instance != got["instance"]
    assert await asyncio.to_thread(LocalRowReader(tmp_path / "again.sock").hello) == again.app[LOCAL_COPY].instance
    other = await make_server(StoreTarget("local", str(tmp_path / "s3"), str(tmp_path / "i3"), None))
    with pytest.raises(NotFound, match="no local socket"):  # (started without --local-socket)
        await asyncio.to_thread(HttpRowReader(other.url).local_socket)


async def test_the_socket_checks_tokens_and_tenants_as_http_does(
        make_server: ServerFactory, local_target: StoreTarget, tmp_path: Path, tokens_file: str) -> None:
    sock = tmp_path / "mint.sock"
    server = await make_server(local_target, local_socket=str(sock), tokens_file=tokens_file)
    (loc,) = await _published(server.url, TOKENS["acme"], 1)

    def read(token: str | None) -> bytes:
        buf, fd = _memfd(loc.length)
        try:
            LocalRowReader(sock, token).read_blob(loc.content_id, lambda n: (buf, fd))
        finally:
            os.close(fd)
        return buf.tobytes()

    async with MintClient(server.url, token=TOKENS["acme-read"]) as c:
        assert await asyncio.to_thread(read, TOKENS["acme-read"]) == bytes(await c.read_row(loc))
    with pytest.raises(BlobNotFound):  # another tenant's content: the 404 GET answers, nothing copied
        await asyncio.to_thread(read, TOKENS["beta"])
    with pytest.raises(PermissionError, match="missing bearer token"):
        await asyncio.to_thread(read, None)
    with pytest.raises(PermissionError, match="unknown token"):
        await asyncio.to_thread(read, "x" * 20)
    with pytest.raises(BlobNotFound):
        await asyncio.to_thread(LocalRowReader(sock, TOKENS["admin"]).read_blob, "0" * 32, lambda n: _memfd(n))
    assert server.app[LOCAL_COPY].copies == 1


async def test_a_ref_resolved_on_the_socket_is_answered_as_post_resolve_answers_it(
        make_server: ServerFactory, local_target: StoreTarget, tmp_path: Path, tokens_file: str) -> None:
    sock = tmp_path / "mint.sock"
    server = await make_server(local_target, local_socket=str(sock), tokens_file=tokens_file)
    (loc,) = await _published(server.url, TOKENS["acme"], 1)
    refs = ["acme/x0", f"sha:{loc.content_id}", "acme/x0:nope", "beta/x0", "acme/nothing"]

    def over_http(token: str) -> list[Any]:
        out: list[Any] = []
        for ref in refs:
            try:
                out.append(HttpRowReader(server.url, token).resolve(ref))
            except Exception as e:  # (compared by type and message below)
                out.append((type(e), str(e)))
        return out

    def on_socket(token: str) -> list[Any]:
        reader, out = LocalRowReader(sock, token), []
        for ref in refs:
            try:
                out.append(reader.resolve(ref))
            except Exception as e:
                out.append((type(e), str(e)))
        reader.close()
        return out

    for who in ("acme-read", "admin", "beta"):
        want = await asyncio.to_thread(over_http, TOKENS[who])
        assert await asyncio.to_thread(on_socket, TOKENS[who]) == want, who
    tenant = await asyncio.to_thread(on_socket, TOKENS["acme-read"])
    assert tenant[0] == tenant[1] and tenant[0].content_id == loc.content_id and tenant[0].shard_key == ""
    assert (await asyncio.to_thread(on_socket, TOKENS["admin"]))[0].shard_key.startswith("packs/")  # (an admin: where)
    assert [x[0].__name__ for x in tenant[2:]] == ["TagNotFound", "Forbidden", "AdapterNotFound"]  # (typed, as HTTP)
    copies = server.app[LOCAL_COPY]
    assert copies.resolves == 3 * len(refs) + 2 * len(refs)
    with pytest.raises(PermissionError, match="unknown token"):
        await asyncio.to_thread(LocalRowReader(sock, "x" * 20).resolve, "acme/x0")
    reader = LocalRowReader(sock, TOKENS["acme-read"])
    with pytest.raises(BadRequest, match="one ref of 1 to"):
        await asyncio.to_thread(reader.resolve, "a/" + "b" * 2000)
    assert (await asyncio.to_thread(reader.resolve, "acme/x0")).content_id == loc.content_id  # (still answering)
    reader.close()


async def test_a_damaged_shard_is_never_copied(
        make_server: ServerFactory, local_target: StoreTarget, tmp_path: Path) -> None:
    server, sock, loc = await _one_row(make_server, local_target, tmp_path)
    async with MintClient(server.url) as c:
        admin = await c.resolve(f"sha:{loc.content_id}")  # (no tokens: the admin's view, with its shard)
    path = LocalStorage(local_target.url).local_path(admin.shard_key)
    assert path is not None
    with open(path, "r+b") as f:  # a flipped byte in the row's middle: the file is another now
        f.seek(admin.offset + admin.length // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    buf, fd = _memfd(loc.length)
    try:
        with pytest.raises(IntegrityError):
            await asyncio.to_thread(LocalRowReader(sock).read_blob, loc.content_id, lambda n: (buf, fd))
    finally:
        os.close(fd)
    assert not buf.any()  # nothing written into the caller's memory
    assert server.app[LOCAL_COPY].copies == 0


async def test_a_damaged_shard_is_never_copied_into_a_kept_mapping_either(
        make_server: ServerFactory, local_target: StoreTarget, tmp_path: Path) -> None:
    sock = tmp_path / "mint.sock"
    server = await make_server(local_target, local_socket=str(sock))
    good, bad = await _published(server.url, None, 2, rank=64, layers=4, hidden=1024)
    async with MintClient(server.url) as c:
        want = bytes(await c.read_row(good))
        admin = await c.resolve(f"sha:{bad.content_id}")
    reader = LocalRowReader(sock)
    buf, fd = RowBuffers(1 << 30).take_shared(max(good.length, bad.length))
    for _ in range(2):  # the second through the service's mapping of the buffer
        await asyncio.to_thread(reader.read_blob, good.content_id, lambda n: (buf.numpy(), fd))
    assert server.app[LOCAL_COPY].targets.reused == 1
    path = LocalStorage(local_target.url).local_path(admin.shard_key)
    assert path is not None
    with open(path, "r+b") as f:
        f.seek(admin.offset + admin.length // 3)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(IntegrityError):
        await asyncio.to_thread(reader.read_blob, bad.content_id, lambda n: (buf.numpy(), fd))
    assert buf.numpy()[: good.length].tobytes() == want  # nothing of the damaged row written
    reader.close()


async def test_bad_input_gets_a_clear_error_and_the_socket_stays_responsive(
        make_server: ServerFactory, local_target: StoreTarget, tmp_path: Path) -> None:
    server, sock, loc = await _one_row(make_server, local_target, tmp_path)
    silent = [socket.socket(socket.AF_UNIX) for _ in range(3)]
    for s in silent:  # connected, never sending: each waits in a thread of its own
        s.connect(str(sock))

    def frame(msg: object) -> bytes:
        data = msgpack.packb(msg)
        return struct.pack(">I", len(data)) + data

    def exchange(payload: bytes) -> dict:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(sock))
            s.sendall(payload)
            n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
            return msgpack.unpackb(s.recv(n, socket.MSG_WAITALL))

    got = await asyncio.to_thread(exchange, struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
    assert got["error"] == "bad_request" and got["status"] == 400
    got = await asyncio.to_thread(exchange, struct.pack(">I", 1 << 30))
    assert got["error"] == "bad_request" and "at most" in got["message"]
    got = await asyncio.to_thread(exchange, frame({"v": 1, "content_id": "../../etc"}))
    assert got["status"] == 400
    got = await asyncio.to_thread(exchange, frame(["not", "a", "map"]))
    assert got["status"] == 400

    def into(make: object) -> None:
        LocalRowReader(sock).read_blob(loc.content_id, make)  # type: ignore[arg-type]

    _, small_fd = _memfd(loc.length // 2)
    with pytest.raises(BadRequest, match=f"holds {loc.length // 2} bytes; the row is {loc.length}"):
        await asyncio.to_thread(into, lambda n: (np.zeros(n, np.uint8), small_fd))
    ro = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT)
    os.ftruncate(small_fd, loc.length)
    with pytest.raises(BadRequest, match="open for writing"):
        await asyncio.to_thread(into, lambda n: (np.zeros(n, np.uint8), ro))
    r, w = os.pipe()
    with pytest.raises(BadRequest, match="memfd or regular file"):
        await asyncio.to_thread(into, lambda n: (np.zeros(n, np.uint8), w))
    for fd in (small_fd, ro, r, w):
        os.close(fd)
    buf, fd = _memfd(loc.length)  # and the socket still answers, the silent connections still open
    await asyncio.to_thread(LocalRowReader(sock).read_blob, loc.content_id, lambda n: (buf, fd))
    async with MintClient(server.url) as c:
        assert buf.tobytes() == bytes(await c.read_row(loc))
    os.close(fd)
    for s in silent:
        s.close()


async def test_a_socket_with_every_connection_taken_is_a_connection_failure_not_an_answer(
        make_server: ServerFactory, local_target: StoreTarget, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's 503 when all its connections are open: the caller reads over HTTP instead
    (ConnectionFailed), as for a socket that is not there, rather than failing the load."""
    import mint_store.service.local_copy as local_copy

    _server, sock, loc = await _one_row(make_server, local_target, tmp_path)
    monkeypatch.setattr(local_copy, "MAX_CONNECTIONS", 1)
    first = LocalRowReader(sock)
    assert (await asyncio.to_thread(first.resolve, f"sha:{loc.content_id}")).content_id == loc.content_id
    with pytest.raises(ConnectionFailed):  # (the 503 frame, or the connection it closes: either way)
        await asyncio.to_thread(LocalRowReader(sock).read_blob, loc.content_id, lambda n: _memfd(n))
    with pytest.raises(ConnectionFailed):  # (the 503 frame, or the connection it closes: either way)
        await asyncio.to_thread(LocalRowReader(sock).resolve, f"sha:{loc.content_id}")
    first.close()


async def test_a_socket_that_is_not_there_is_a_connection_failure(tmp_path: Path) -> None:
    with pytest.raises(ConnectionFailed, match="local copy socket"):
        await asyncio.to_thread(LocalRowReader(tmp_path / "none.sock").read_blob, "0" * 32, _memfd)


def test_bytes_that_are_not_the_content_ids_are_refused(tmp_path: Path) -> None:
    """A socket that copies wrong bytes (or reports more than it copied): IntegrityError, never the row."""
    adapter = random_adapter(0, rank=8)
    layout, row = adapter.to_row()
    cid, data = adapter.content_id(), row.tobytes()
    path = tmp_path / "fake.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(4)
    modes = ["flip", "short-report", "ok"]

    def serve() -> None:
        for mode in modes:
            conn, _ = listener.accept()
            with conn:
                n = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))[0]
                conn.recv(n, socket.MSG_WAITALL)
                head = msgpack.packb({"length": len(data), "layout_id": layout.layout_id})
                conn.sendall(struct.pack(">I", len(head)) + head)
                _, anc, _, _ = conn.recvmsg(1024, socket.CMSG_SPACE(4))
                fd = struct.unpack("i", anc[0][2][:4])[0]
                body = bytearray(data)
                if mode == "flip":
                    body[len(body) // 3] ^= 1
                os.pwrite(fd, bytes(body[: len(body) // 2] if mode == "short-report" else body), 0)
                os.close(fd)
                end = msgpack.packb({"done": len(data), "end": True})
                conn.sendall(struct.pack(">I", len(end)) + end)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    for _mode in modes[:2]:
        bad = _memfd(len(data))
        with pytest.raises(IntegrityError, match="does not match"):
            LocalRowReader(path).read_blob(cid, lambda n, bad=bad: bad)
        os.close(bad[1])
    buf, fd = _memfd(len(data))
    loc, _ = LocalRowReader(path).read_blob(cid, lambda n: (buf, fd))
    assert buf.tobytes() == data and loc.layout_id == layout.layout_id
    os.close(fd)
    t.join(5)
    listener.close()
