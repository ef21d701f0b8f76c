"""vLLM serves LoRA adapters straight from MinT Store: a ``LoRAResolver`` plugin.

vLLM loads the plugin through the entry point ``mint_lora_resolver`` in the group
``vllm.general_plugins`` (``pip install 'mint-store[vllm]'``). With ``MINT_SERVER`` or
``MINT_STORE`` set, a request whose ``model`` is a MinT ref (``acme/support``,
``acme/support@3``, ``acme/support:prod``) is served with that adapter: the resolver checks
the adapter's base against the served model and hands vLLM the content's row path, which
vLLM's worker loads straight from the store (:mod:`.direct`); on a vLLM the direct path does
not support it writes the PEFT files once per content id into a local cache (atomically,
LRU-evicted by bytes) and hands vLLM the directory.

Modules, one concept each; only :mod:`.plugin`, :mod:`.compat`, :mod:`.hooks`, :mod:`.slots` and
:mod:`.row_plan` import vLLM:

- :mod:`.config`   -- the settings, read from the environment (``MINT_VLLM_*``)
- :mod:`.bases`    -- how a MinT base name relates to vLLM's ``base_model_name``
- :mod:`.ids`      -- stable positive ``lora_int_id`` per content id
- :mod:`.cache`    -- the on-disk cache of PEFT directories keyed by content id
- :mod:`.seal`     -- an entry's keyed seal: only what this cache wrote is served
- :mod:`.cache_root` -- the cache directory is private to its user; its sealing key
- :mod:`.errors`   -- :class:`~.errors.UnsafeCacheDir`
- :mod:`.paths`    -- the ``lora_path`` handed to vLLM: a function of the content id
- :mod:`.resolver` -- ref -> checked answer: a row path, or a materialised directory (no vLLM)
- :mod:`.follower` -- drops names from a running OpenAI server when their tag moves
- :mod:`.preload`  -- warms the content a tag moved to before the switch; preloads at start
- :mod:`.compat`   -- which vLLM the direct path supports (checked at start)
- :mod:`.direct`   -- rows straight into vLLM's worker: one read, views, vLLM's own copy
- :mod:`.hooks`    -- vLLM's LoRA entry points in the worker, wrapped for the direct path
- :mod:`.slots`    -- a MinT adapter's LoRA slot zeroed only where vLLM's copy leaves rows
- :mod:`.residency` -- what the server holds, exported on ``/metrics`` for LoRA routers
- :mod:`.plugin`   -- the vLLM ``LoRAResolver`` over it, and ``register()``

See docs/vllm.md.
"""

from __future__ import annotations

from .config import RESOLVER_NAME, PluginConfig
from .resolver import AdapterUnavailable, MintResolver, Resolution, WrongBase

__all__ = ["RESOLVER_NAME", "AdapterUnavailable", "MintResolver", "PluginConfig", "Resolution", "WrongBase"]
