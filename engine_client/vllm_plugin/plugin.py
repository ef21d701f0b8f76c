"""The vLLM side: a ``LoRAResolver`` over :class:`~.resolver.MintResolver`, and ``register()``.

``register`` is the entry point (group ``vllm.general_plugins``). vLLM calls it in each of
its processes; it reads the environment, checks the cache directory (created ``0700``; one
another user could change stops vLLM with the fix) and registers the resolver (the client and
the cache open on the first request). vLLM's OpenAI server asks its resolvers for any
``model`` it does not know when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; offline code
can ask directly: ``await LoRAResolverRegistry.get_resolver(RESOLVER_NAME).resolve_lora(...)``.

What vLLM gets: a ``LoRARequest`` (``lora_name`` = the ref as asked, ``lora_path`` = the
content's row path, which vLLM's worker loads straight from the store (:mod:`.direct`), or
the cached PEFT directory on a vLLM the direct path does not support; ``lora_int_id`` stable
per content id, which the OpenAI server replaces with its own counter); ``None`` for a name
that is not a MinT adapter it can see (the server answers 404); a 400 error for an adapter
of another base; a 503 error when the store cannot be reached or fails.

In an OpenAI server the plugin also follows the store (:mod:`.follower`), warms what a
moved tag now names before switching it and preloads ``MINT_VLLM_PRELOAD`` (:mod:`.preload`),
and exports which adapters the server holds for LoRA-affinity routers (:mod:`.residency`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from vllm.lora.request import LoRARequest  # type: ignore[import-not-found,unused-ignore]
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry  # type: ignore[import-not-found,unused-ignore]

from .cache_root import prepare_root
from .compat import check_vllm
from .config import RESOLVER_NAME, PluginConfig
from .follower import TagFollower, is_openai_server, own_api_key, own_server_url
from .preload import ServerLoRA, preload_at_start, warm
from .residency import DIR_ENV, Residency, ResidencyCollector
from .resolver import AdapterUnavailable, MintResolver, WrongBase

if TYPE_CHECKING:
    from .direct import DirectLoader

# a child of vLLM's logger: our lines go where vLLM's go, and vLLM's logging setup keeps them
log = logging.getLogger("vllm.plugins.mint_lora_resolver")

def _wrong_base_error(message: str) -> Exception:
    try:
        from vllm.exceptions import VLLMValidationError  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # older vLLM: its fallback handler answers 400 for ValueError
        return ValueError(message)
    return VLLMValidationError(message, parameter="model")  # type: ignore[no-any-return,unused-ignore]


def _unavailable_error(message: str) -> Exception:
    try:
        from vllm.exceptions import GracefulHTTPError  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return RuntimeError(message)
    return GracefulHTTPError(message, HTTPStatus.SERVICE_UNAVAILABLE)  # type: ignore[no-any-return,unused-ignore]


class MintLoRAResolver(LoRAResolver):  # type: ignore[misc,unused-ignore]
    """Thin: runs the blocking :class:`MintResolver` in a thread and speaks vLLM's types."""

    def __init__(self, resolver: MintResolver) -> None:
        self.resolver = resolver
        self._follower: TagFollower | None = None
        self._follow_checked = False
        self._lock = threading.RLock()  # (follower() asks server() under it)
        self._server: ServerLoRA | None = None
        self._base: str | None = None  # the served model as vLLM names it to resolvers

    def server(self) -> ServerLoRA | None:
        """This process's own OpenAI server (None offline)."""
        with self._lock:
            if self._server is None:
                url = self.resolver.config.server_url or own_server_url()
                if url is not None:
                    self._server = ServerLoRA(url, own_api_key())
            return self._server

    def _warm(self, lora_name: str, content_id: str) -> bool:
        """Load what ``lora_name`` moved to, then switch the name to it; True when switched."""
        server = self.server()
        if server is None:
            return False
        got = warm(server, self.resolver.resolve, lambda: self._base or server.base_model(), lora_name, content_id,
                   self.resolver.config.cache_dir)
        return got is not None

    def follower(self) -> TagFollower | None:
        """The tag follower of this process's OpenAI server (None offline or with MINT_VLLM_FOLLOW=0).

        Decided at the first resolve: by then the process is known to be an OpenAI server or not.
        """
        with self._lock:
            if not self._follow_checked:
                self._follow_checked = True
                config = self.resolver.config
                server = self.server() if config.follow else None
                if server is not None:
                    client = self.resolver.client
                    self._follower = TagFollower(self.resolver.current, lambda: client.events(0, limit=0).head,
                                                 client.follow, server.unload, logger=log,
                                                 release=self.resolver.release,
                                                 warm=self._warm if config.warm else None)
                    log.info("MinT: following %s; moved tags are %s on the server at %s", config.url,
                             "loaded, then switched" if config.warm else "dropped", server.url)
            return self._follower

    def preload(self) -> None:
        """Load ``MINT_VLLM_PRELOAD`` into this process's OpenAI server once it answers."""
        server = self.server()
        refs = self.resolver.config.preload
        if server is None or not refs:
            return

        def resolve(base: str, ref: str) -> Any:
            self._base = self._base or base
            return self.resolver.resolve_tracked(base, ref, self.follower())

        preload_at_start(server, refs, resolve)

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        self._base = self._base or base_model_name
        follower = self.follower()
        try:
            got = await asyncio.to_thread(self.resolver.resolve_tracked, base_model_name, lora_name, follower)
        except WrongBase as e:
            raise _wrong_base_error(str(e)) from e
        except AdapterUnavailable as e:
            raise _unavailable_error(str(e)) from e
        if got is None:
            return None
        return LoRARequest(lora_name=lora_name, lora_int_id=got.lora_int_id, lora_path=got.path,
                           base_model_name=base_model_name)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the resolver when a store is configured."""
    config = PluginConfig.from_env()
    if config is None:
        log.debug("MinT: neither MINT_SERVER nor MINT_STORE is set; the LoRA resolver is not registered")
        return
    prepare_root(config.cache_dir)  # an unsafe cache directory stops vLLM now, naming the fix (not at a request)
    # the API server itself, not the engine's processes it starts later (they inherit DIR_ENV)
    api_server = is_openai_server() and DIR_ENV not in os.environ
    if api_server:
        directory = config.cache_dir / "residency" / str(os.getpid())
        os.environ[DIR_ENV] = str(directory)
        _register_collector(ResidencyCollector(directory))
    loader = _install_direct(config)
    direct = loader is not None and config.load != "files"
    # (the loader of this process: the resolver asks the service's socket it finds, where there is one)
    resolver = MintLoRAResolver(MintResolver(config, logger=log, direct=direct, local=loader if direct else None))
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, resolver)
    log.info("MinT: LoRA resolver registered for %s (%s; cache %s, %d bytes)", config.url,
             "rows straight into vLLM" if direct else "PEFT files", config.cache_dir, config.cache_bytes)
    if api_server:
        resolver.preload()


def _install_direct(config: PluginConfig) -> DirectLoader | None:
    """Wrap vLLM's LoRA loading where this vLLM allows it: the loader (None: it does not)."""
    support = check_vllm()
    if not support.ok:
        if config.load == "direct":
            raise RuntimeError(f"MINT_VLLM_LOAD=direct, but {support.problem}: the direct row path supports "
                               "vLLM 0.32 (set MINT_VLLM_LOAD=files, or install a supported vLLM)")
        log.warning("MinT: %s; adapters are loaded from PEFT files (the direct row path needs vLLM 0.32)",
                    support.problem)
        return None
    if not support.tested:
        log.warning("MinT: vLLM %s is not one the direct row path is tested on (0.32); its LoRA entry points "
                    "match, so rows go straight in (MINT_VLLM_LOAD=files to use PEFT files)", support.version)
    from .hooks import install

    return install(config, residency=Residency.from_env())


def _register_collector(collector: ResidencyCollector) -> None:
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return
    REGISTRY.register(collector)
