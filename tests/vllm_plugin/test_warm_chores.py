"""A load's chores (the row cache's copy, the next spare buffer) can be waited for: a load that
warms content ahead of a tag's switch waits for them (hooks.py), so that none of them runs
during the requests after the switch."""

from __future__ import annotations

import threading
from pathlib import Path

from engine_client import SyncMintClient
from engine_client.vllm_plugin import PluginConfig
from engine_client.vllm_plugin.direct import DirectLoader
from mint_store.service import ServerThread, ServiceConfig
from tests.support.factories import random_adapter


def test_settle_chores_returns_once_the_row_cache_holds_the_row_and_the_spare_is_made(tmp_path: Path) -> None:
    (tmp_path / "uploads").mkdir()
    server = ServerThread(ServiceConfig(store=str(tmp_path / "served"), host="127.0.0.1", port=0, workers=2,
                                        upload_dir=str(tmp_path / "uploads"), auto_compact=False))
    try:
        with SyncMintClient(server.url) as c:
            cid = c.publish("acme", "x", random_adapter(3, rank=64, layers=4, hidden=1024)).content_id
            want = bytes(c.read_row(c.resolve(f"sha:{cid}")))
        assert len(want) > 1 << 20  # (a pooled buffer: its kind gets a spare)
        loader = DirectLoader(PluginConfig(url=server.url, cache_dir=tmp_path / "cache"))
        cached = tmp_path / "cache" / "row-cache" / f"{cid}.row"
        gate = threading.Event()
        loader._writer.submit(gate.wait)  # the chores' thread still busy with an earlier one
        row = loader.read("/rows/0", cid)
        assert row.buf.numpy().tobytes() == want and row.shared  # (over HTTP: the worker writes the cache)
        assert not cached.exists()
        assert not loader.settle_chores(timeout=0.2)  # not done while the earlier chore runs
        threading.Timer(0.3, gate.set).start()
        assert loader.settle_chores()
        assert cached.read_bytes() == want
        assert loader.buffers.spares == 1 and loader.buffers.settle(timeout=0)
    finally:
        server.stop()
