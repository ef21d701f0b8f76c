"""vLLM serves LoRA adapters straight from MinT Store: a ``LoRAResolver`` plugin.

vLLM loads the plugin through the entry point ``mint_lora_resolver`` in the group
``vllm.general_plugins`` (``pip install 'mint-store[vllm]'``). With ``MINT_SERVER`` or
``MINT_STORE`` set, a request whose ``model`` is a MinT ref (``acme/support``,
``acme/support@3``, ``acme/support:prod``) is served with that adapter: the resolver checks
the adapter's base against the served model, writes its PEFT files once per content id
into a local cache (atomically, LRU-evicted by bytes) and hands vLLM the directory.

Modules, one concept each; only :mod:`.plugin` imports vLLM:

- :mod:`.config`   -- the settings, read from the environment (``MINT_VLLM_*``)
- :mod:`.bases`    -- how a MinT base name relates to vLLM's ``base_model_name``
- :mod:`.ids`      -- stable positive ``lora_int_id`` per content id
- :mod:`.cache`    -- the on-disk cache of PEFT directories keyed by content id
- :mod:`.seal`     -- an entry's keyed seal: only what this cache wrote is served
- :mod:`.cache_root` -- the cache directory is private to its user; its sealing key
- :mod:`.errors`   -- :class:`~.errors.UnsafeCacheDir`
- :mod:`.resolver` -- ref -> checked, materialised adapter (no vLLM; unit-tested alone)
- :mod:`.follower` -- drops names from a running OpenAI server when their tag moves
- :mod:`.plugin`   -- the vLLM ``LoRAResolver`` over it, and ``register()``

See docs/vllm.md.
"""

from __future__ import annotations

from .config import RESOLVER_NAME, PluginConfig
from .resolver import AdapterUnavailable, MintResolver, Resolution, WrongBase

__all__ = ["RESOLVER_NAME", "AdapterUnavailable", "MintResolver", "PluginConfig", "Resolution", "WrongBase"]
