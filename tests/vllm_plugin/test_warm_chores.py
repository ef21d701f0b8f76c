"""A load that warms content ahead of a tag's switch: the worker marks it warm once the load's
chores (the row cache's copy, the next spare buffer) are done, and the switch waits for the
mark (preload.py), so that none of them runs during the requests after the switch."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine_client import SyncMintClient
from engine_client.vllm_plugin import PluginConfig, preload
from engine_client.vllm_plugin.direct import DirectLoader
from engine_client.vllm_plugin.paths import row_path, warm_marker
from engine_client.vllm_plugin.preload import wait_for
from engine_client.vllm_plugin.residency import WARM_MARK
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
        mark = warm_marker(tmp_path / "cache", f"acme/x:prod{WARM_MARK}{cid}.0001")
        gate = threading.Event()
        loader._writer.submit(gate.wait)  # an earlier chore still running
        loader.read("/rows/0", cid)
        loader.mark_warm(cid, f"acme/x:prod{WARM_MARK}{cid}.0001")
        assert not wait_for(mark, 0.3)  # not before the chores queued ahead of it
        gate.set()
        assert wait_for(mark, 10.0)
        assert (tmp_path / "cache" / "row-cache" / f"{cid}.row").exists()  # (the cache's copy came first)
    finally:
        server.stop()


class _Server:
    """vLLM's runtime LoRA API as warm() calls it; its worker marks a side load warm ``delay`` s later."""

    def __init__(self, cache: Path, delay: float | None) -> None:
        self.cache, self.delay = cache, delay
        self.calls: list[tuple[str, str, float]] = []

    def load(self, name: str, path: str, *, exist_ok: bool = False) -> None:
        self.calls.append(("load", name, time.monotonic()))
        if WARM_MARK in name and self.delay is not None:
            mark = warm_marker(self.cache, name)
            mark.parent.mkdir(parents=True, exist_ok=True)
            threading.Timer(self.delay, mark.touch).start()

    def unload(self, name: str) -> None:
        self.calls.append(("unload", name, time.monotonic()))


def test_the_switch_waits_for_its_own_side_loads_marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, cid = tmp_path / "cache", "ab" * 16
    got = SimpleNamespace(path=row_path(cache, cid), content_id=cid)
    server = _Server(cache, delay=0.3)
    assert preload.warm(server, lambda base, ref: got, lambda: "base", "acme/x:prod", cid, cache) is got
    side = server.calls[0][1]
    assert side.startswith(f"acme/x:prod{WARM_MARK}{cid}.")  # (a name of its own: no earlier marker is its)
    assert [c[:2] for c in server.calls] == [("load", side), ("unload", side), ("unload", "acme/x:prod"),
                                             ("load", "acme/x:prod")]
    assert server.calls[2][2] - server.calls[1][2] >= 0.25  # the switch waited for the worker's marker
    assert not warm_marker(cache, side).exists()  # (consumed)

    monkeypatch.setattr(preload, "WARM_WAIT_S", 0.2)  # a worker that never marks: switched after the wait
    silent = _Server(cache, delay=None)
    preload.warm(silent, lambda base, ref: got, lambda: "base", "acme/x:prod", cid, cache)
    assert [c[0] for c in silent.calls] == ["load", "unload", "unload", "load"]
    assert silent.calls[2][2] - silent.calls[1][2] >= 0.15
    files = SimpleNamespace(path=str(cache / "entries" / cid), content_id=cid)  # the files path marks nothing
    other = _Server(cache, delay=None)
    t0 = time.monotonic()
    preload.warm(other, lambda base, ref: files, lambda: "base", "acme/x:prod", cid, cache)
    assert time.monotonic() - t0 < 0.15 and len(other.calls) == 4  # (no wait for a marker that never comes)
