"""Run by test_slots.py in its own process: every LoRA slot byte after each activation.

    python slots_run.py SPEC.json OUT.json

SPEC: {"model": dir, "steps": [["local", label, dir] | ["mint", label, ref]], "dirty": bool
(every slot byte set to 1, and nothing recorded, before the first activation)}. One offline
``LLM`` (one LoRA slot, the worker in this process) with the plugin registered from the
environment. After every activation, each linear LoRA layer's slot is compared with vLLM's
own semantics, written out as a reference loop: the slot all zeros, A copied into rows
``[:r]``, B into columns ``[:r]``, per slice. Writes the tokens of each step and the counts.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import torch
    from support import ENGINE, MAX_TOKENS, PROMPTS
    from vllm import LLM, SamplingParams
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolverRegistry

    from engine_client.vllm_plugin import RESOLVER_NAME, slots

    llm = LLM(model=spec["model"], **(ENGINE | {"max_loras": 1, "distributed_executor_backend": "uni"}))
    resolver = LoRAResolverRegistry.get_resolver(RESOLVER_NAME)
    checked = {"slots": 0, "mismatched": [], "activations": 0}
    activate = LoRAModelManager.activate_adapter  # (the plugin's wrapper: this one runs around it)

    def expected(stack: torch.Tensor, w: torch.Tensor | None, index: int) -> torch.Tensor:
        want = torch.zeros_like(stack[index])  # [1, rows, cols]
        if w is not None:
            want[0, : w.shape[0], : w.shape[1]] = w
        return want

    def checked_activate(self: Any, lora_id: int) -> bool:
        if spec.get("dirty") and checked["activations"] == 0:
            # every slot byte stale and nothing recorded of it (as after vLLM reallocated its stacks,
            # or a write this code never saw): the first activation must clear all of it
            for module in self.modules.values():
                if isinstance(module, BaseLinearLayerWithLoRA):
                    for stack in (*module.lora_a_stacked, *module.lora_b_stacked):
                        stack.fill_(1)
                    for record in ("_mint_ranks", "_mint_views", "_mint_geometry"):
                        module.__dict__.pop(record, None)
        done = activate(self, lora_id)
        if not done:
            return done
        checked["activations"] += 1
        model = self._registered_adapters.cache[lora_id]
        index = self.lora_index_to_id.index(lora_id)
        for name, module in self.modules.items():
            if not isinstance(module, BaseLinearLayerWithLoRA):
                continue
            w = self._get_lora_layer_weights(model, name)
            a_list = (w.lora_a if isinstance(w.lora_a, list) else [w.lora_a]) if w else [None] * module.n_slices
            b_list = (w.lora_b if isinstance(w.lora_b, list) else [w.lora_b]) if w else [None] * module.n_slices
            for i, (sa, sb) in enumerate(zip(module.lora_a_stacked, module.lora_b_stacked, strict=True)):
                for what, stack, t in (("A", sa, a_list[i]), ("B", sb, b_list[i])):
                    checked["slots"] += 1
                    if not torch.equal(stack[index], expected(stack, t, index)):
                        checked["mismatched"].append(f"{name} slice {i} {what} of lora {lora_id}")
        return done

    LoRAModelManager.activate_adapter = checked_activate
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = []
    for i, (how, label, where) in enumerate(spec["steps"], start=1):
        if how == "local":
            request = LoRARequest(f"local-{label}-{i}", 1000 + i, where)
        else:
            request = asyncio.run(resolver.resolve_lora(spec["model"], where))
        outs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    Path(sys.argv[2]).write_text(json.dumps({"tokens": tokens, "checked": checked, "counts": slots.counts}))


if __name__ == "__main__":
    main()
