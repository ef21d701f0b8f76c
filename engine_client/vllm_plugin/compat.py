"""Which vLLM the direct row path (:mod:`.direct`) supports, checked before anything is patched.

The direct path wraps three of vLLM's LoRA entry points in the worker (and, for its
adapters' activation, ``LoRAModelManager.activate_adapter`` and the linear layers'
``set_lora``/``reset_lora``: :mod:`.slots`):
``WorkerLoRAManager._load_adapter`` (timing, residency), ``PEFTHelper.from_local_dir`` (the
config of a row) and ``LoRAModel.from_local_checkpoint`` (the tensors of a row, handed to
vLLM's own ``LoRAModel.from_lora_tensors``, or built into a ``LoRAModel`` by a layout's plan
with ``LoRALayerWeights.from_config``, as ``from_lora_tensors`` does: :mod:`.row_plan`). They
are internal API, so a vLLM is taken only when each has the parameters the wrappers pass on;
a vLLM outside :data:`TESTED` that still has them is taken with a warning. Anything else falls
back to PEFT files (``MINT_VLLM_LOAD=auto``) or stops vLLM at start (``MINT_VLLM_LOAD=direct``), naming what is missing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TESTED = ("0.32.",)  # vLLM releases the direct path is tested on (make test-vllm)

# the parameters each wrapped function must take (the wrappers pass them through by name)
_NEEDS: dict[str, set[str]] = {
    "LoRAModel.from_local_checkpoint": {"lora_dir", "expected_lora_modules", "peft_helper", "lora_model_id",
                                        "device", "dtype", "model_vocab_size", "weights_mapper", "skip_prefixes"},
    "LoRAModel.from_lora_tensors": {"lora_model_id", "tensors", "peft_helper", "device", "dtype",
                                    "model_vocab_size", "weights_mapper", "skip_prefixes"},
    "PEFTHelper.from_local_dir": {"lora_path", "max_position_embeddings"},
    "PEFTHelper.from_dict": {"config_dict"},
    "WorkerLoRAManager._load_adapter": {"self", "lora_request"},
    # what a layout's plan (row_plan.py) builds a LoRAModel with, as from_lora_tensors does
    "LoRALayerWeights.from_config": {"module_name", "peft_helper", "peft_module_name"},
    "LoRAModel.__init__": {"lora_model_id", "rank", "loras", "modules_to_save"},
    "LoRAModel._should_skip_module": {"module_name", "skip_prefixes"},
    # a MinT adapter's activation zeroes only what the copy leaves (slots.py)
    "LoRAModelManager.activate_adapter": {"self", "lora_id"},
    "BaseLinearLayerWithLoRA.set_lora": {"self", "index", "lora_a", "lora_b"},
    "BaseLinearLayerWithLoRA.reset_lora": {"self", "index"},
}


@dataclass(frozen=True, slots=True)
class Support:
    version: str
    problem: str | None  # why the direct path cannot run on this vLLM; None: it can
    tested: bool

    @property
    def ok(self) -> bool:
        return self.problem is None


def check_vllm() -> Support:
    """Whether the installed vLLM has the entry points :mod:`.direct` wraps, as it calls them."""
    try:
        import vllm
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.lora_weights import LoRALayerWeights
        from vllm.lora.model_manager import LoRAModelManager
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.worker_manager import WorkerLoRAManager
    except ImportError as e:
        return Support("unknown", f"vLLM's LoRA modules do not import ({e})", False)
    version = str(getattr(vllm, "__version__", "unknown"))
    owners = {"LoRAModel": LoRAModel, "PEFTHelper": PEFTHelper, "WorkerLoRAManager": WorkerLoRAManager,
              "LoRALayerWeights": LoRALayerWeights, "LoRAModelManager": LoRAModelManager,
              "BaseLinearLayerWithLoRA": BaseLinearLayerWithLoRA}
    from vllm.lora import utils

    for helper in ("parse_fine_tuned_lora_name", "get_lora_id", "is_base_embedding_weights"):
        if not callable(getattr(utils, helper, None)):
            return Support(version, f"vLLM {version} has no vllm.lora.utils.{helper}", False)
    try:  # (the plan pins tensors as from_lora_tensors does, by vLLM's own flag)
        from vllm.utils.torch_utils import PIN_MEMORY  # noqa: F401
    except ImportError:
        return Support(version, f"vLLM {version} has no vllm.utils.torch_utils.PIN_MEMORY", False)
    for where, needs in _NEEDS.items():
        owner, _, attr = where.partition(".")
        fn = getattr(owners[owner], attr, None)
        if fn is None:
            return Support(version, f"vLLM {version} has no {where}", False)
        missing = needs - _params(fn)
        if missing:
            return Support(version, f"vLLM {version}'s {where} takes no {', '.join(sorted(missing))}", False)
    return Support(version, None, version.startswith(TESTED))


def _params(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
