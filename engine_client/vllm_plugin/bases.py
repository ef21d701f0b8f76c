"""How a MinT base name relates to the ``base_model_name`` vLLM passes to resolvers.

vLLM passes the model it serves as given on its command line (``vllm serve MODEL``):
a Hugging Face id (``Qwen/Qwen3-4B``) or a local path (``/models/qwen3-4b``). MinT base
names are publisher-chosen names of the grammar ``[a-z0-9][a-z0-9._-]{0,63}``
(``qwen3-4b``). The rule:

1. With ``MINT_VLLM_BASE`` set, the served model's MinT base name is exactly that value and
   ``base_model_name`` is not consulted. Use it whenever the model's path or id does not
   end in its MinT base name.
2. Otherwise it is the last path component of ``base_model_name`` (trailing ``/`` ignored),
   lowercased: ``Qwen/Qwen3-4B`` -> ``qwen3-4b``, ``/models/qwen3-4b/`` -> ``qwen3-4b``.

An adapter is served only when its base equals that name exactly; adapters published
without a base (``unspecified``) are never served. That is the engine's rule too, and it is
written (with its reason) once, in :mod:`engine_client.engine.base_compat`.
"""

from __future__ import annotations

from mint_store.errors import InvalidName
from mint_store.format.adapter import UNSPECIFIED_BASE
from mint_store.format.names import check_name

from ..engine.base_compat import base_refusal


def served_base(base_model_name: str, override: str | None = None) -> str:
    """The MinT base name of the model vLLM serves (may fail the name grammar; then nothing matches)."""
    if override:
        return override
    return base_model_name.rstrip("/").rsplit("/", 1)[-1].lower()


def base_mismatch(adapter_base: str, base_model_name: str, override: str | None = None) -> str | None:
    """None when an adapter of ``adapter_base`` may run on ``base_model_name``; else why not
    (the rule is :func:`engine_client.engine.base_compat.base_refusal`)."""
    want = served_base(base_model_name, override)
    how = "MINT_VLLM_BASE" if override else f"the served model {base_model_name!r}"
    if adapter_base != UNSPECIFIED_BASE:
        try:
            check_name(want, "base")
        except InvalidName:
            return (
                f"the served model {base_model_name!r} has no valid MinT base name ({want!r}) to compare with "
                f"the adapter's base {adapter_base!r}; set MINT_VLLM_BASE to the base its adapters are published "
                "under"
            )
    return base_refusal(adapter_base, want, server=f"this vLLM ({how})")
