"""The worker's direct loader with MINT_LOCAL_SOCKET: rows the service on this machine copies into
its memfd buffers, HTTP while the socket is not there, the service's typed answers raised; by
default the socket the service names, where the server answering there is that service."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine_client import SyncMintClient
from engine_client.vllm_plugin import PluginConfig
from engine_client.vllm_plugin.direct import DirectLoader
from engine_client.vllm_plugin.paths import row_path
from engine_client.vllm_plugin.resolver import MintResolver
from mint_store.errors import BlobNotFound, NotFound
from mint_store.service import ServerThread, ServiceConfig
from mint_store.service.errors import BadRequest
from mint_store.service.local_copy import LOCAL_COPY, _error, _send
from tests.support.factories import random_adapter

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux's")


def test_rows_come_through_the_socket_and_over_http_while_it_is_not_there(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "uploads").mkdir()
    sock = tmp_path / "mint.sock"
    server = ServerThread(ServiceConfig(store=str(tmp_path / "served"), host="127.0.0.1", port=0, workers=2,
                                        upload_dir=str(tmp_path / "uploads"), auto_compact=False,
                                        local_socket=str(sock)))
    try:
        adapters = [random_adapter(s, rank=32, layers=4) for s in range(3)]
        with SyncMintClient(server.url) as c:
            cids = [c.publish("acme", f"x{i}", a).content_id for i, a in enumerate(adapters)]
            want = [bytes(c.read_row(c.resolve(f"sha:{cid}"))) for cid in cids]
        loader = DirectLoader(PluginConfig(url=server.url, local_socket=sock, cache_dir=tmp_path / "cache"))
        copies = server.server.app[LOCAL_COPY]
        row = loader.read("/rows/0", cids[0])
        assert row.buf.numpy().tobytes() == want[0]
        assert (loader.reads, loader.local_reads) == (1, 1)
        # the row cache's copy is the service's too, into the cache's file: the worker's buffer
        # is nobody else's, so B is a view of it that vLLM may scale in place
        assert loader._writer.settle()
        assert copies.copies == 2
        cached = tmp_path / "cache" / "row-cache" / f"{cids[0]}.row"
        assert cached.read_bytes() == want[0]
        assert not row.shared
        b = next(v for k, v in row.tensors.items() if ".lora_B." in k)
        lo = row.buf.data_ptr()
        assert lo <= b.data_ptr() < lo + row.buf.numel()
        with pytest.raises(BlobNotFound):  # the service's answer, not a reason to try HTTP
            loader.read("/rows/x", "0" * 32)
        assert loader.local_rows() is not None

        os.rename(sock, tmp_path / "elsewhere.sock")  # the socket is gone: HTTP, with a warning
        row = loader.read("/rows/1", cids[1])
        assert row.buf.numpy().tobytes() == want[1]
        assert (loader.reads, loader.local_reads) == (2, 1)
        assert "reading rows over HTTP" in caplog.text
        assert loader.local_rows() is None  # (for LOCAL_RETRY_S: no connect tried on each load)
        loader._local_down_until = 0.0
        os.rename(tmp_path / "elsewhere.sock", sock)  # back: rows through it again
        row = loader.read("/rows/2", cids[2])
        assert row.buf.numpy().tobytes() == want[2]
        assert loader._writer.settle()
        assert (loader.reads, loader.local_reads, copies.copies) == (3, 2, 4)
        assert (tmp_path / "cache" / "row-cache" / f"{cids[1]}.row").read_bytes() == want[1]  # (HTTP: its own)
    finally:
        server.stop()


def test_the_next_buffer_is_shown_to_the_service_before_its_row_so_that_row_lands_through_a_mapping(
        tmp_path: Path) -> None:
    """The pool's spare (made after the read, off the load's path) goes to the service at once
    (``keep``): the next cold row of that size is a pread into the service's mapping of it."""
    sock = tmp_path / "mint.sock"
    server = _serve(tmp_path, "served", sock)
    try:
        adapters = [random_adapter(s, rank=64, layers=4, hidden=1024) for s in range(2)]
        with SyncMintClient(server.url) as c:
            cids = [c.publish("acme", f"x{i}", a).content_id for i, a in enumerate(adapters)]
            want = [bytes(c.read_row(c.resolve(f"sha:{cid}"))) for cid in cids]
        loader = DirectLoader(PluginConfig(url=server.url, local_socket=sock, cache_dir=tmp_path / "cache",
                                           cache_bytes=0))
        targets = server.server.app[LOCAL_COPY].targets
        first = loader.read("/rows/0", cids[0])
        assert loader.buffers.settle(timeout=60) and loader.buffers.spares == 1
        assert (targets.prepared, targets.reused) == (1, 0)  # the spare, mapped before any row is in it
        second = loader.read("/rows/1", cids[1])  # while the first is still held (vLLM's CPU cache)
        assert loader.buffers.reused == 1 and targets.reused == 1  # into the spare, through the mapping
        assert [first.buf.numpy().tobytes(), second.buf.numpy().tobytes()] == want
        assert loader.local_reads == 2
        loader.client().close()
    finally:
        server.stop()


def test_the_resolver_asks_the_socket_the_loader_found_and_http_while_it_is_not_there(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sock = tmp_path / "mint.sock"
    server = _serve(tmp_path, "served", sock)
    try:
        with SyncMintClient(server.url) as c:
            cid = c.publish("acme", "x", random_adapter(1), tag="prod").content_id
        config = PluginConfig(url=server.url, cache_dir=tmp_path / "cache")  # (MINT_LOCAL_SOCKET=auto)
        loader = DirectLoader(config)
        resolver = MintResolver(config, direct=True, local=loader)
        copies = server.server.app[LOCAL_COPY]
        got = resolver.lookup("tiny", "acme/x:prod")
        assert (got.content_id, got.path) == (cid, str(row_path(config.cache_dir, cid)))
        assert copies.resolves == 1  # on the socket the service named: no POST /v1/resolve
        with pytest.raises(NotFound):  # its typed answer, as over HTTP
            resolver.lookup("tiny", "acme/nothing")
        assert copies.resolves == 2
        os.rename(sock, tmp_path / "elsewhere.sock")  # gone (and the kept connection closed): HTTP, warned
        loader.local_rows().close()
        assert resolver.lookup("tiny", "acme/x:prod").content_id == cid
        assert copies.resolves == 2 and "reading rows over HTTP" in caplog.text
        assert loader.local_rows() is None  # (for LOCAL_RETRY_S: the loader's reads go over HTTP too)
        loader._local_down_until = 0.0
        os.rename(tmp_path / "elsewhere.sock", sock)  # back: found again, resolves on it again
        assert resolver.lookup("tiny", "acme/x:prod").content_id == cid and copies.resolves == 3
        caplog.clear()
        # a service from before `resolve` (it takes the ask for a read without a content id): HTTP
        # for resolves, no warning, and the socket kept for rows
        newer = copies._resolve
        copies._resolve = lambda conn, request: _send(conn, _error(BadRequest(
            "expected {'v': 1, 'token': ..., 'content_id': ...}")))
        assert resolver.lookup("tiny", "acme/x:prod").content_id == cid
        assert resolver.lookup("tiny", "acme/x:prod").content_id == cid  # (asked over HTTP at once, the 2nd time)
        assert "reading rows over HTTP" not in caplog.text and loader.local_rows() is not None
        assert loader.local_rows().resolves is False
        copies._resolve = newer
        resolver.close()
        loader.client().close()
    finally:
        server.stop()


def _serve(tmp_path: Path, name: str, sock: Path | None) -> ServerThread:
    (tmp_path / f"uploads-{name}").mkdir()
    return ServerThread(ServiceConfig(store=str(tmp_path / name), host="127.0.0.1", port=0, workers=2,
                                      upload_dir=str(tmp_path / f"uploads-{name}"), auto_compact=False,
                                      local_socket=None if sock is None else str(sock)))


def test_the_loader_finds_the_socket_of_its_own_service_and_no_other(tmp_path: Path) -> None:
    """MINT_SERVER alone: the socket the service names, where the server there is that service."""
    servers = {n: _serve(tmp_path, n, None if n == "plain" else tmp_path / f"{n}.sock") for n in ("a", "b", "plain")}
    try:
        cids, want = {}, {}
        for n, server in servers.items():
            with SyncMintClient(server.url) as c:
                cids[n] = c.publish("acme", "x", random_adapter(7, rank=16, layers=2)).content_id
                want[n] = bytes(c.read_row(c.resolve(f"sha:{cids[n]}")))

        def load(n: str, **options: object) -> DirectLoader:
            loader = DirectLoader(PluginConfig(url=servers[n].url, cache_dir=tmp_path / f"cache-{n}", **options))
            assert loader.read("/rows/0", cids[n]).buf.numpy().tobytes() == want[n]
            assert loader._writer.settle()  # (the row cache's copy: the service's too, where it copied the row)
            return loader

        copies = servers["a"].server.app[LOCAL_COPY]
        assert (load("a").local_reads, copies.copies) == (1, 2)  # found: the service copied the row
        assert (load("a", find_socket=False).local_reads, copies.copies) == (0, 2)  # MINT_LOCAL_SOCKET=off
        plain = load("plain")  # a service without a socket: HTTP, and not asked again on the next load
        assert plain.local_reads == 0 and plain.local_rows() is None

        # b's server answers at the path a's service names: not a's, so not taken (HTTP instead)
        os.rename(tmp_path / "a.sock", tmp_path / "a-moved.sock")
        os.rename(tmp_path / "b.sock", tmp_path / "a.sock")
        b_copies = servers["b"].server.app[LOCAL_COPY].copies
        assert load("a").local_reads == 0
        assert (copies.copies, servers["b"].server.app[LOCAL_COPY].copies) == (2, b_copies)
        os.rename(tmp_path / "a.sock", tmp_path / "b.sock")
        os.rename(tmp_path / "a-moved.sock", tmp_path / "a.sock")
        assert load("a").local_reads == 1  # its own again
    finally:
        for server in servers.values():
            server.stop()


def test_the_socket_setting_goes_with_a_service() -> None:
    with pytest.raises(ValueError, match="MINT_LOCAL_SOCKET is the socket of the service"):
        PluginConfig.from_env({"MINT_STORE": "/data/mint", "MINT_LOCAL_SOCKET": "/run/mint.sock"})
    config = PluginConfig.from_env({"MINT_SERVER": "http://127.0.0.1:8470", "MINT_LOCAL_SOCKET": "~/mint.sock"})
    assert config is not None and config.local_socket == Path("~/mint.sock").expanduser()
    for text, find in (("", True), ("auto", True), ("off", False), ("0", False)):
        config = PluginConfig.from_env({"MINT_SERVER": "http://127.0.0.1:8470", "MINT_LOCAL_SOCKET": text})
        assert config is not None and (config.local_socket, config.find_socket) == (None, find)
    config = PluginConfig.from_env({"MINT_STORE": "/data/mint", "MINT_LOCAL_SOCKET": "off"})  # (nothing to find)
    assert config is not None and config.local_socket is None
