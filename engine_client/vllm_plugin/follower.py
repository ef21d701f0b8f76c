"""Tag following: a name a running vLLM server holds is dropped when the store moves it.

vLLM's OpenAI server keeps every adapter name it has resolved (``lora_requests``) and asks
resolvers only for names it does not hold, so without help a moved tag or a rollback would
keep serving the old content. :class:`TagFollower` follows the store's change feed; when
an event touches a name the server resolved (a tag or "latest" that now names other
content, a deleted or quarantined version), it asks the server to drop that name through
vLLM's runtime LoRA API (``POST /v1/unload_lora_adapter``, present with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). The next request for the name goes to the
resolver again and gets the current content. Requests already running keep the
``LoRARequest`` they started with, so they finish on the content they started with.

Pinned names (``tenant/name@3``, ``sha:<content id>``) never change content: a tag move
never drops them; only a delete or a quarantine of what they name does.

Delay: a change is seen one feed round trip after its commit (a long poll on a service,
``poll_interval`` on a store opened in this process), then one local HTTP call drops it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from mint_store.format.names import parse_ref

log = logging.getLogger(__name__)

Drop = Callable[[str], None]
Current = Callable[[str], "str | None"]


class TagFollower:
    """Which names this server holds, and the feed loop that drops the ones that moved.

    Parameters
    ----------
    current
        ``current(lora_name)`` -> the content id the name resolves to now, or None when it
        no longer resolves (deleted, quarantined, gone). Raises on a store error.
    head
        ``head()`` -> the change feed's current position.
    follow
        ``follow(after)`` -> an iterator of change-feed events after ``after`` that rides
        out restarts of the store's service.
    drop
        ``drop(lora_name)`` makes the server forget the name (raises when it could not).
    release
        ``release(content_id)``: no name the server holds names ``content_id`` any more (its
        files need not be kept); None: nothing is told.
    warm
        ``warm(lora_name, content_id)``: load the content a held name moved to before the name
        switches (:mod:`.preload`); True when the server now serves the name with it (kept,
        tracked as the new content), else the name is dropped. None: the next request loads
        it. A warm-up that fails is logged and the name dropped all the same.
    """

    def __init__(self, current: Current, head: Callable[[], int],
                 follow: Callable[[int], Iterable[Mapping[str, Any]]], drop: Drop, *,
                 logger: logging.Logger | None = None, retry_delay: float = 1.0,
                 release: Callable[[str], None] | None = None,
                 warm: Callable[[str, str], bool | None] | None = None) -> None:
        self._current = current
        self._head = head
        self._follow = follow
        self._drop = drop
        self._release = release
        self._warm = warm
        self.log = logger or log
        self.retry_delay = retry_delay
        self._held: dict[str, str] = {}  # lora_name -> content id it was resolved to
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.dropped = 0  # names dropped so far (tests and logs read it)

    # -- what the resolver tells us ---------------------------------------------------------

    def track(self, lora_name: str, content_id: str) -> None:
        """The server now holds ``lora_name`` as ``content_id``; starts the feed loop once."""
        with self._lock:
            was = self._held.get(lora_name)
            self._held[lora_name] = content_id
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mint-vllm-follow", daemon=True)
                self._thread.start()
        if was is not None and was != content_id:  # (resolved again while it was being resolved)
            self._unheld(was)

    def _unheld(self, content_id: str) -> None:
        """Tell ``release`` when no held name names ``content_id`` any more."""
        with self._lock:
            still = content_id in self._held.values()
        if not still and self._release is not None:
            try:
                self._release(content_id)
            except Exception as e:  # the cache's files stay held: more disk, never a failed request
                self.log.warning("MinT: could not release %s from the adapter cache (%s: %s)", content_id,
                                 type(e).__name__, e)

    def stop(self) -> None:
        """Follow no more (the loop ends at its next event or error; the thread is a daemon)."""
        self._stopped.set()

    def held(self) -> dict[str, str]:
        with self._lock:
            return dict(self._held)

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                after = self._head()
                # what changed between a resolve and this position has no event left to see
                self.recheck(list(self.held()))
                for event in self._follow(after):
                    if self._stopped.is_set():
                        return
                    self.apply(event)
                return
            except Exception as e:  # the feed broke in a way follow() did not ride out
                if self._stopped.is_set():
                    return
                self.log.warning("MinT: the change feed failed (%s: %s); following again in %.1fs",
                                 type(e).__name__, e, self.retry_delay)
                if self._stopped.wait(self.retry_delay):
                    return

    def apply(self, event: Mapping[str, Any]) -> list[str]:
        """Recheck the held names ``event`` may have changed; returns the names dropped."""
        return self.recheck(affected(event, self.held()))

    def recheck(self, names: Sequence[str]) -> list[str]:
        dropped = []
        for name in names:
            with self._lock:
                was = self._held.get(name)
            if was is None:
                continue
            now = self._current(name)
            if now == was:
                continue
            if now is not None and self._warm is not None:
                try:
                    switched = self._warm(name, now)
                except Exception as e:  # the name is dropped all the same: the next request loads it cold
                    switched = False
                    self.log.warning("MinT: could not warm %s for %r before switching it (%s: %s)", now, name,
                                     type(e).__name__, e)
                if switched:  # the server serves the name with the new content now
                    with self._lock:
                        if self._held.get(name) == was:
                            self._held[name] = now
                    self._unheld(was)
                    self.log.info("MinT: %r moved from %s to %s; loaded, then switched", name, was, now)
                    continue
            self._drop(name)
            with self._lock:
                if self._held.get(name) == was:  # not re-resolved meanwhile
                    del self._held[name]
            self._unheld(was)
            self.dropped += 1
            dropped.append(name)
            self.log.info("MinT: %r moved from %s to %s; vLLM will resolve it again", name, was, now or "nothing")
        return dropped


def affected(event: Mapping[str, Any], held: Mapping[str, str]) -> list[str]:
    """The held names whose content ``event`` may have changed."""
    kind = event.get("kind")
    if kind == "quarantine":
        bad = set(event.get("content_ids") or ())
        return [n for n, cid in held.items() if cid in bad]
    if kind == "publish":
        touched = {(i["tenant"], i["name"]) for i in event.get("items") or ()}
    elif kind in ("tag", "untag", "delete"):
        touched = {(event.get("tenant"), event.get("name"))}
    else:  # base, compact, sweep: no ref changes content
        return []
    out = []
    for name in held:
        ref = parse_ref(name)
        if ref.content_id is not None:
            if kind == "delete":  # a sha: ref lives while some version of the caller's tenants holds it
                out.append(name)
        elif (ref.tenant, ref.name) in touched and (ref.version is None or kind == "delete"):
            out.append(name)
    return out


# -- this process's own OpenAI server ------------------------------------------------------


def own_server_url(argv: Sequence[str] | None = None) -> str | None:
    """This process's OpenAI server, when this process is one (else None).

    From ``--host``/``--port`` of the command line of ``vllm serve`` or
    ``python -m vllm.entrypoints.openai.api_server`` (vLLM's defaults: all interfaces, port
    8000), reached on loopback. ``MINT_VLLM_URL`` (:class:`.config.PluginConfig`) overrides it.
    """
    if argv is None:
        if not is_openai_server():
            return None
        argv = sys.argv
    host = _flag(argv, "--host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if _flag(argv, "--ssl-keyfile") else "http"
    return f"{scheme}://{host}:{_flag(argv, '--port') or '8000'}"


def own_api_key(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    return _flag(sys.argv if argv is None else argv, "--api-key") or env.get("VLLM_API_KEY") or None


def is_openai_server() -> bool:
    """This process runs vLLM's OpenAI server (forked children inherit the module: callers check more)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (getattr(spec, "name", "") == "vllm.entrypoints.openai.api_server"
            or "vllm.entrypoints.openai.api_server" in sys.modules)


def _flag(argv: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None
