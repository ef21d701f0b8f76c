"""The vLLM side: a ``LoRAResolver`` over :class:`~.resolver.MintResolver`, and ``register()``.

``register`` is the entry point (group ``vllm.general_plugins``). vLLM calls it in each of
its processes; it reads the environment, checks the cache directory (created ``0700``; one
another user could change stops vLLM with the fix) and registers the resolver (the client and
the cache open on the first request). vLLM's OpenAI server asks its resolvers for any
``model`` it does not know when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; offline code
can ask directly: ``await LoRAResolverRegistry.get_resolver(RESOLVER_NAME).resolve_lora(...)``.

What vLLM gets: a ``LoRARequest`` (``lora_name`` = the ref as asked, ``lora_path`` = the
cached PEFT directory, ``lora_int_id`` stable per content id; the OpenAI server replaces
the id with its own counter); ``None`` for a name that is not a MinT adapter it can see
(the server answers 404); a 400 error for an adapter of another base; a 503 error when
the store cannot be reached or fails.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from http import HTTPStatus

from vllm.lora.request import LoRARequest  # type: ignore[import-not-found,unused-ignore]
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry  # type: ignore[import-not-found,unused-ignore]

from .cache_root import prepare_root
from .config import RESOLVER_NAME, PluginConfig
from .follower import ServerUnloader, TagFollower, own_api_key, own_server_url
from .resolver import AdapterUnavailable, MintResolver, WrongBase

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
        self._lock = threading.Lock()

    def follower(self) -> TagFollower | None:
        """The tag follower of this process's OpenAI server (None offline or with MINT_VLLM_FOLLOW=0).

        Decided at the first resolve: by then the process is known to be an OpenAI server or not.
        """
        with self._lock:
            if not self._follow_checked:
                self._follow_checked = True
                config = self.resolver.config
                url = (config.server_url or own_server_url()) if config.follow else None
                if url is not None:
                    client = self.resolver.client
                    self._follower = TagFollower(self.resolver.current, lambda: client.events(0, limit=0).head,
                                                 client.follow, ServerUnloader(url, own_api_key()), logger=log,
                                                 release=self.resolver.release)
                    log.info("MinT: following %s; moved tags are dropped from the server at %s", config.url, url)
            return self._follower

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
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
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, MintLoRAResolver(MintResolver(config, logger=log)))
    log.info("MinT: LoRA resolver registered for %s (cache %s, %d bytes)", config.url, config.cache_dir,
             config.cache_bytes)
