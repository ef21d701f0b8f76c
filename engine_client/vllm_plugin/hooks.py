"""vLLM's LoRA entry points in the worker, wrapped for the direct row path (:mod:`.direct`).

``install`` wraps, once per process (:func:`.compat.check_vllm` said this vLLM can):
``WorkerLoRAManager._load_adapter`` (timing, residency), ``PEFTHelper.from_local_dir`` (the
config of a row), ``LoRAModel.from_local_checkpoint`` (the row's tensors, or a clone of a
``LoRAModel`` of the same content) and ``LoRAModelManager.activate_adapter`` (a MinT adapter's
slot zeroed only where the copy leaves rows: :mod:`.slots`). Paths that are not MinT's go to
vLLM's own functions untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from .config import PluginConfig
from .direct import DirectLoader
from .paths import content_of
from .residency import WARM_MARK, Residency


def install(config: PluginConfig, *, residency: Residency | None = None) -> DirectLoader:
    """Wrap vLLM's LoRA loading in this process (once; :func:`.compat.check_vllm` said it can)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import WorkerLoRAManager

    from . import slots

    done: DirectLoader | None = getattr(WorkerLoRAManager._load_adapter, "_mint_loader", None)
    if done is not None:  # registered again (tests do): the wrappers stay, the settings are the new ones
        done.reconfigure(config, residency)
        return done
    loader = DirectLoader(config, residency=residency)
    load_adapter = WorkerLoRAManager._load_adapter
    from_local_dir = PEFTHelper.from_local_dir.__func__
    from_local_checkpoint = LoRAModel.from_local_checkpoint.__func__
    activate_adapter = LoRAModelManager.activate_adapter
    slots.install()

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        t0 = time.perf_counter()
        path = lora_request.lora_path
        with loader.loading(path):
            lora = load_adapter(self, lora_request)
        took = time.perf_counter() - t0
        got = content_of(loader.config.cache_dir, path)
        if got is not None and got[1] and WARM_MARK in (lora_request.lora_name or ""):
            # content warmed ahead of a tag's switch (preload.py): the follower switches the name
            # once this load's chores are done, so that they do not run during the requests after
            # the switch (the engine's loop does not wait for them)
            loader.mark_warm(got[0], lora_request.lora_name)
        loader.residency.loaded(self._adapter_manager, lora_request, lora, took,
                                content_id=got[0] if got else None,
                                how="direct" if got and got[1] else "files")
        return lora

    def _from_local_dir(cls: Any, lora_path: str, max_position_embeddings: int | None, *args: Any,
                        **kwargs: Any) -> Any:
        got = content_of(loader.config.cache_dir, lora_path)
        if got is None or not got[1]:
            return from_local_dir(cls, lora_path, max_position_embeddings, *args, **kwargs)
        config = dict(loader.config_of(lora_path, got[0]))
        config["vllm_max_position_embeddings"] = max_position_embeddings  # what from_local_dir adds
        return cls.from_dict(config)

    def _from_local_checkpoint(cls: Any, lora_dir: str, expected_lora_modules: set[str], peft_helper: Any,
                               *, lora_model_id: int | None = None, **kwargs: Any) -> Any:
        got = content_of(loader.config.cache_dir, lora_dir)
        if got is None:
            return from_local_checkpoint(cls, lora_dir, expected_lora_modules, peft_helper,
                                         lora_model_id=lora_model_id, **kwargs)
        content_id, is_row = got
        have = loader.model(content_id)
        if have is not None and lora_model_id is not None and kwargs.get("moe_ep_spec") is None:
            loader.clones += 1
            with loader._lock:
                loader._rows.pop(lora_dir, None)
            clone = have.clone(lora_model_id)  # shares vLLM's tensors of that content: nothing read
            loader.remember(content_id, clone)  # (vLLM may drop the original first)
            return clone
        if not is_row:
            model = from_local_checkpoint(cls, lora_dir, expected_lora_modules, peft_helper,
                                          lora_model_id=lora_model_id, **kwargs)
        else:
            row = loader.take(lora_dir, content_id)
            spec = kwargs.get("moe_ep_spec")
            if lora_model_id is None:
                from vllm.lora.utils import get_lora_id  # type: ignore[attr-defined,unused-ignore]

                lora_model_id = get_lora_id()
            model = None
            if row.plan is not None and spec is None:
                model = row.plan.model(
                    cls, row.buf, row.scalings, lora_model_id=lora_model_id, peft_helper=peft_helper,
                    expected=expected_lora_modules, device=kwargs.get("device", "cuda"), dtype=kwargs.get("dtype"),
                    weights_mapper=kwargs.get("weights_mapper"), skip_prefixes=kwargs.get("skip_prefixes"),
                    check=lambda keys: _check_modules(keys, expected_lora_modules, peft_helper, lora_dir, kwargs),
                    fold=(lambda n: loader.buffers.take(n, pin=row.buf.is_pinned())) if row.shared else None)
            if model is not None:
                loader.remember(content_id, model)
                return model
            tensors = row.tensors
            _check_modules(tensors, expected_lora_modules, peft_helper, lora_dir, kwargs)
            if spec is not None:
                from vllm.lora.lora_model import _is_remote_expert_key

                tensors = {k: v for k, v in tensors.items() if not _is_remote_expert_key(k, spec)}
            model = cls.from_lora_tensors(
                lora_model_id=lora_model_id, tensors=tensors, peft_helper=peft_helper,
                device=kwargs.get("device", "cuda"), dtype=kwargs.get("dtype"),
                model_vocab_size=kwargs.get("model_vocab_size"), weights_mapper=kwargs.get("weights_mapper"),
                skip_prefixes=kwargs.get("skip_prefixes"),
            )
        loader.remember(content_id, model)
        return model

    def _activate_adapter(self: Any, lora_id: int) -> bool:
        held = getattr(self._registered_adapters, "cache", self._registered_adapters)  # (no LRU touch)
        model = held.get(lora_id)
        with slots.activating(getattr(model, "_mint_content_id", None) is not None):
            return bool(activate_adapter(self, lora_id))

    # inspect.signature (compat.check_vllm) sees through the wrappers to vLLM's own parameters
    _load_adapter.__wrapped__ = load_adapter  # type: ignore[attr-defined]
    _from_local_dir.__wrapped__ = from_local_dir  # type: ignore[attr-defined]
    _from_local_checkpoint.__wrapped__ = from_local_checkpoint  # type: ignore[attr-defined]
    _activate_adapter.__wrapped__ = activate_adapter  # type: ignore[attr-defined]
    _load_adapter._mint_loader = loader  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = _load_adapter
    PEFTHelper.from_local_dir = classmethod(_from_local_dir)
    LoRAModel.from_local_checkpoint = classmethod(_from_local_checkpoint)
    LoRAModelManager.activate_adapter = _activate_adapter
    return loader


def _check_modules(tensors: Iterable[str], expected: set[str], peft_helper: Any, where: str,
                   kwargs: dict[str, Any]) -> None:
    """vLLM's own check of ``from_local_checkpoint``: every module is one the model can take."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    skip = kwargs.get("skip_prefixes") or ()
    unexpected: list[str] = []
    for key in tensors:  # (the PEFT names)
        if "base_layer" in key or any(f".{p}" in key or key.startswith(p) for p in skip):
            continue
        module, _ = parse_fine_tuned_lora_name(key, kwargs.get("weights_mapper"))
        if ".experts" in module:
            if module[module.find(".experts") + 1:] not in expected:
                unexpected.append(module)
        elif module.rsplit(".", 1)[-1] not in expected and module.rsplit(".", 1)[-1] not in (
                peft_helper.modules_to_save or ()):
            unexpected.append(module)
    if unexpected:
        raise ValueError(f"While loading {where}, expected target modules in {expected} but received "
                         f"{unexpected}. Please verify that the loaded LoRA module is correct")
