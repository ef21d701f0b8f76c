"""A load that warms content ahead of a tag's switch: the worker marks it warm once the load's
chores (the row cache's copy, the next spare buffer) are done, and the switch waits for the
mark (preload.py), so that none of them runs during the requests after the switch."""

from __future__ import annotations

import threading
from pathlib import Path

from engine_client import SyncMintClient
from engine_client.vllm_plugin import PluginConfig
from engine_client.vllm_plugin.direct import DirectLoader
from engine_client.vllm_plugin.paths import warm_marker
from engine_client.vllm_plugin.preload import wait_for
from mint_store.service import ServerThread, ServiceConfig
from tests.support.factories import random_adapter


def test_the_warm_marker_comes_after_the_chores_and_the_switch_waits_for_it(tmp_path: Path) -> None:
    (tmp_path / "uploads").mkdir()
    server = ServerThread(ServiceConfig(store=str(tmp_path / "served"), host="127.0.0.1", port=0, workers=2,
                                        upload_dir=str(tmp_path / "uploads"), auto_compact=False))
    try:
        with SyncMintClient(server.url) as c:
            cid = c.publish("acme", "x", random_adapter(4, rank=16, layers=2)).content_id
        loader = DirectLoader(PluginConfig(url=server.url, cache_dir=tmp_path / "cache"))
        mark = warm_marker(tmp_path / "cache", cid)
        gate = threading.Event()
        loader._writer.submit(gate.wait)  # an earlier chore still running
        loader.read("/rows/0", cid)
        loader.mark_warm(cid)
        assert not wait_for(mark, 0.3)  # not before the chores queued ahead of it
        gate.set()
        assert wait_for(mark, 10.0)
        assert (tmp_path / "cache" / "row-cache" / f"{cid}.row").exists()  # (the cache's copy came first)
    finally:
        server.stop()
