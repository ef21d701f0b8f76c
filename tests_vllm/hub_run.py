"""Run by test_hub.py in its own process: vLLM loads LoRA adapters by Hub repo id from MinT's /hf.

    python hub_run.py SPEC.json OUT.json

SPEC: {"model": dir, "direct": {label: peft dir}, "repos": {label: "tenant/name"},
"engine": {more LLM args}}. The
environment sets HF_ENDPOINT to the MinT service's /hf and VLLM_PLUGINS to none: vLLM's own
LoRA loader downloads the repo through huggingface_hub, as it would from the Hub. Writes
greedy tokens for the base, every original directory and every repo id.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from support import ENGINE, MAX_TOKENS, PROMPTS
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolverRegistry

    llm = LLM(model=spec["model"], **ENGINE, **spec.get("engine", {}))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(request: LoRARequest | None) -> list[list[int]]:
        outs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    out: dict = {"base": run(None), "direct": {}, "hub": {},
                 "resolvers": sorted(LoRAResolverRegistry.get_supported_resolvers())}
    for i, (label, path) in enumerate(spec["direct"].items(), start=1):
        out["direct"][label] = run(LoRARequest(f"direct-{label}", i, path))
    for i, (label, repo) in enumerate(spec["repos"].items(), start=101):
        out["hub"][label] = run(LoRARequest(f"hub-{label}", i, repo))  # the path is a repo id
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
