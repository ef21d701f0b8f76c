"""Helpers of the vLLM tests: a tiny random Llama, PEFT adapters, a loopback MinT service.

Nothing is downloaded: the model is built from a config with seeded random weights and
saved with ``save_pretrained``; vLLM runs it with ``skip_tokenizer_init`` on token ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mint_store.service import ServerThread

BASE = "tiny-llama"  # the model directory's name is its MinT base name (docs/vllm.md)
PROMPTS = [[1, 5, 9, 13, 17, 21], [200, 100, 50, 25], [7, 7, 7, 3, 11, 250, 31, 64]]
MAX_TOKENS = 8
# engine arguments shared by the offline LLM and `vllm serve` (small: 2 cores, no GPU)
ENGINE = {
    "skip_tokenizer_init": True, "enforce_eager": True, "enable_lora": True, "max_lora_rank": 8,
    "max_loras": 4, "max_model_len": 256, "max_num_seqs": 8, "dtype": "float32", "seed": 0,
    "kv_cache_memory_bytes": 64 << 20,
}
# Where an offline run (LLM(), not `vllm serve`) puts vLLM's parts. Each process vLLM starts
# imports vLLM again (about 10 s here on 2 cores, most of a test's time), so an offline run runs
# the engine core in the calling process (OFFLINE_ENV) and keeps only the executor its case needs:
# "mp" keeps vLLM's worker process, where the direct path's loader reads rows; "uni" runs the
# worker in the calling process too (the files path and vLLM's own Hub loader, where vLLM gets a
# directory). `vllm serve` (test_serve.py) keeps vLLM's whole default layout: API server, engine
# core and worker, each its own process.
OFFLINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# (name, lora seed, LoraConfig fields): two layouts, two scalings
ADAPTERS = [
    ("a", 11, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
    ("b", 12, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
    ("c", 13, {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]}),
]


def llama_config() -> Any:
    import transformers as tf

    return tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
        initializer_range=0.2,
    )


def build_model(path: Path) -> Path:
    import torch
    import transformers as tf

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tf.LlamaForCausalLM(llama_config()).save_pretrained(str(path))
    return path


def build_adapter(path: Path, seed: int, lora: dict[str, Any]) -> Path:
    """A PEFT LoRA adapter of the tiny Llama with random, non-zero A and B."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(llama_config())
    pm = get_peft_model(model, LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    pm.save_pretrained(str(path))
    return path


def serve_store(store: Path, local_socket: Path | None = None) -> ServerThread:
    """The real MinT service over ``store`` on 127.0.0.1 (any free port), in a thread; with
    ``local_socket``, also its Unix socket of same-machine row copies there."""
    from mint_store.service import ServerThread, ServiceConfig

    (store.parent / "uploads").mkdir(parents=True, exist_ok=True)
    return ServerThread(ServiceConfig(store=str(store), host="127.0.0.1", port=0, workers=2, auto_compact=False,
                                      upload_dir=str(store.parent / "uploads"),
                                      local_socket=None if local_socket is None else str(local_socket)))


def free_port() -> int:
    """A port free a moment ago: whoever binds it may lose a race, so callers retry on a clash."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def refused_url() -> Iterator[str]:
    """A loopback URL that refuses connections: the port stays bound (never listening) meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def plugin_env(cache_dir: Path, **mint: str) -> dict[str, str]:
    """The environment of a vLLM process that uses the plugin (no hub, loopback only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MINT_", "VLLM_"))}
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "MINT_VLLM_CACHE_DIR": str(cache_dir),
    })
    env.update(mint)
    return env


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=1))
    return path


def run_bounded(cmd: list[str], *, timeout: float, env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """Run ``cmd`` in its own process group; on timeout the whole group (vLLM's workers too) is killed."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, f"timed out after {timeout}s\n" + out.decode(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind
    return proc.returncode, out.decode(errors="replace")


@dataclass
class World:
    model: Path  # the base model directory (its name is the MinT base name)
    adapters: dict[str, Path]  # label -> original PEFT directory


@dataclass
class Mint:
    server: ServerThread
    store: Path  # the service's store directory
    content: dict[str, str]  # acme/<label> -> content id
    socket: Path  # the service's Unix socket of same-machine row copies (MINT_LOCAL_SOCKET)


def start_mint(world: World, root: Path) -> Mint:
    """A loopback MinT service holding the adapters:

    acme/a, acme/b, acme/c (tag prod each); acme/moving @1 = a, @2 = b, prod -> @1;
    acme/elsewhere = a published for another base.
    """
    from engine_client import SyncMintClient
    from mint_store.peft.directory import load_peft_dir

    server = serve_store(root / "store", root / "mint.sock")
    content = {}
    with SyncMintClient(server.url) as c:
        for label, path in world.adapters.items():
            content[f"acme/{label}"] = c.publish("acme", label, load_peft_dir(path, base=BASE), tag="prod").content_id
        for label in ("a", "b"):
            c.publish("acme", "moving", load_peft_dir(world.adapters[label], base=BASE))
        c.tag("acme/moving@1", "prod")
        c.publish("acme", "elsewhere", load_peft_dir(world.adapters["a"], base="other-model"))
    return Mint(server, root / "store", content, root / "mint.sock")
