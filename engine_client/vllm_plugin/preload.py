"""Warm adapters before anyone asks: at start (``MINT_VLLM_PRELOAD``) and when a followed tag moves.

At start, an OpenAI server loads each ref of ``MINT_VLLM_PRELOAD`` through vLLM's runtime
LoRA API (``POST /v1/load_lora_adapter``, once ``/health`` answers) under the ref itself, so
the first request for it finds it loaded; the follower tracks it like a resolved name.

When a tag the server holds moves (:class:`~.follower.TagFollower`), the new content is loaded
*before* the name is switched (``MINT_VLLM_WARM=on``, the default): first under a side name
(``<ref>#mint-warm-<content id>.<nonce>``, one of its own each time), dropped again at once,
which leaves the content in vLLM's worker; then the name is dropped and loaded again with the
new content's path, so vLLM adds it under a new LoRA id from the content it holds (a clone,
:mod:`.direct`: no read) before the name maps to it. The switch waits (at most ``WARM_WAIT_S``)
until the worker marks that the side load's chores are done (the row cache's copy written out to
disk, the next spare buffer: :meth:`.DirectLoader.mark_warm`), so none of them competes with the
requests after it; vLLM's engine loop never waits for them. The first request after the move is
a warm request; requests already running keep their LoRA id, and so the old content, to their
end. (vLLM's own in-place reload is not used: its ``load_inplace`` flag stays on the name's
request, and vLLM reloads the adapter at every later step that uses it.) ``off``: the name is
dropped and the next request loads the new content.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .paths import content_of, warm_marker
from .residency import WARM_MARK

WARM_WAIT_S = 1.0  # longest a switch waits for the worker's chores (docs/vllm.md: a move is served within 2 s)

log = logging.getLogger("vllm.plugins.mint_lora_resolver.preload")  # where vLLM's own lines go


class ServerLoRA:
    """vLLM's runtime LoRA API of this process's own OpenAI server, on loopback."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, method="POST", headers=headers, data=json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def load(self, lora_name: str, lora_path: str, *, exist_ok: bool = False) -> None:
        status, body = self._post("/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})
        if status == 400 and exist_ok and b"already been loaded" in body:
            return  # (a request resolved it meanwhile: it serves what the store says now)
        if status != 200:
            raise RuntimeError(f"vLLM at {self.url} did not load {lora_name!r}: {status} {body[:300]!r}")

    def unload(self, lora_name: str) -> None:
        status, body = self._post("/v1/unload_lora_adapter", {"lora_name": lora_name})
        if status not in (200, 404):  # 404: the server does not hold it (never loaded, or dropped)
            raise RuntimeError(f"vLLM at {self.url} refused to unload {lora_name!r}: {status} {body[:200]!r}")

    def base_model(self) -> str:
        """The base model as vLLM names it to resolvers (its path: ``root`` of the first model card)."""
        with urllib.request.urlopen(self.url + "/v1/models", timeout=self.timeout) as r:
            cards = json.loads(r.read())["data"]
        base = next(c for c in cards if not c.get("parent"))
        return str(base.get("root") or base["id"])

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(0.5)
        return False


def warm_name(lora_name: str, content_id: str) -> str:
    """A side name of its own for each warm load (its marker is no earlier load's)."""
    return f"{lora_name}{WARM_MARK}{content_id}.{secrets.token_hex(4)}"


Resolve = Callable[[str, str], Any]  # (base model name, lora name) -> Resolution | None


def warm(server: ServerLoRA, resolve: Resolve, base_model: Callable[[], str], lora_name: str,
         content_id: str, cache_dir: Path | None = None) -> Any:
    """Load ``content_id`` into vLLM, then switch ``lora_name`` to it; the resolution of
    ``sha:<content id>`` (base checked), or None when that is not servable (nothing switched).
    With the plugin's ``cache_dir`` and a row path, the switch waits (at most ``WARM_WAIT_S``)
    for the worker's marker that the load's chores are done."""
    got = resolve(base_model(), f"sha:{content_id}")
    if got is None:
        return None
    side = warm_name(lora_name, content_id)
    where = content_of(cache_dir, got.path) if cache_dir is not None else None
    # (a files path goes to vLLM's own loader, which marks nothing)
    mark = warm_marker(cache_dir, side) if cache_dir is not None and where and where[1] else None
    server.load(side, got.path)  # vLLM's worker reads the row: the one cold load, before any switch
    server.unload(side)
    if mark is not None:
        t0 = time.monotonic()
        done = wait_for(mark, WARM_WAIT_S)
        mark.unlink(missing_ok=True)
        log.info("MinT: %s's new content %s warm; its load's chores done %.0f ms after it%s", lora_name,
                 content_id, (time.monotonic() - t0) * 1e3, "" if done else " (not seen: switched anyway)")
    server.unload(lora_name)
    server.load(lora_name, got.path, exist_ok=True)  # a clone of what the worker now holds
    return got


def wait_for(path: Path, timeout: float) -> bool:
    """Whether ``path`` exists within ``timeout`` seconds (looked at every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def preload_at_start(server: ServerLoRA, refs: tuple[str, ...], resolve: Resolve, *,
                     timeout: float = 900.0) -> threading.Thread:
    """Load ``refs`` under their own names once the server answers (in a daemon thread);
    ``resolve`` tracks what it resolves (the follower then follows the preloaded names)."""

    def run() -> None:
        if not server.wait_ready(timeout):
            log.warning("MinT: %s did not become ready in %.0fs; nothing preloaded", server.url, timeout)
            return
        base = server.base_model()
        for ref in refs:
            t0 = time.perf_counter()
            try:
                got = resolve(base, ref)
                if got is None:
                    log.warning("MinT: cannot preload %r: no such adapter", ref)
                    continue
                server.load(ref, got.path)
                log.info("MinT: preloaded %r (content %s) in %.3fs", ref, got.content_id, time.perf_counter() - t0)
            except Exception as e:  # one bad ref does not stop the others (nor the server)
                log.warning("MinT: could not preload %r (%s: %s)", ref, type(e).__name__, e)

    t = threading.Thread(target=run, name="mint-vllm-preload", daemon=True)
    t.start()
    return t
