"""Which adapters may run on a model: one rule, for :class:`~engine_client.LoRAEngine` and the vLLM plugin.

The rule
--------
A model that declares its MinT base ``B`` runs only adapters published for exactly ``B``;
an adapter published without a base (base ``unspecified``) is refused there too. A
:class:`~engine_client.LoRAEngine` declares a base with ``base=``; the vLLM plugin always
does (``MINT_VLLM_BASE``, or the served model's name: see
:mod:`engine_client.vllm_plugin.bases`). A model that declares no base (an engine without
``base=``) runs any adapter whose shapes fit it; the engine checks the shapes of every
layout against the model before its first use either way.

Why ``unspecified`` is refused where a base is declared: a base name is the publisher's word
that the adapter was trained on that model. Without it nothing vouches for the adapter, and
a shape check cannot (two models of one architecture and size have the same shapes); vLLM
does not even check the shapes (it copies a smaller LoRA into its larger buffers). An
operator who declares a base asks for that guarantee, as a vLLM user expects a LoRA made for
another model not to load silently; the fix is one flag at publish time (``--base``).
"""

from __future__ import annotations

from mint_store.format.adapter import UNSPECIFIED_BASE


def base_refusal(adapter_base: str, served: str | None, *, server: str = "this engine") -> str | None:
    """Why an adapter of ``adapter_base`` may not run on a model of base ``served``, or None.

    Parameters
    ----------
    adapter_base
        The base the adapter was published for (``unspecified`` when none was given).
    served
        The MinT base the model declares, or None when it declares none (then only shapes
        are checked, elsewhere).
    server
        Who serves the model, as the reason names it (``"this engine"``, ``"this vLLM"``).

    Returns
    -------
    str or None
        None when the adapter may run; else the reason, with the fix.
    """
    if served is None:
        return None
    if adapter_base == UNSPECIFIED_BASE:
        return (
            f"it was published without a base (base {UNSPECIFIED_BASE!r}) and {server} runs base {served!r}; "
            f"publish it with --base {served} to run it there"
        )
    if adapter_base != served:
        return f"it was published for base {adapter_base!r}, and {server} runs base {served!r}"
    return None
