"""What an adapter switch is compared with, in the same run as the switch itself.

* a full reload of the base from safetensors into the same model: tensor by tensor through
  ``safe_open`` (what transformers' loading does: one copy out of the mapped file, one into
  the parameter), and the raw lower bound of any reload (``os.preadv`` straight into the
  parameters' memory, one copy);
* PEFT's ``load_adapter`` + ``set_adapter`` of the same adapter from its directory;
* vLLM's ``add_lora`` (:mod:`tools.bench.swap_vllm`, in its own process);
* the bytes themselves: the reads, hashes and copies the switches do, done without the
  engine, so the fixed cost of a switch can be told from the cost of its bytes.

Peak memory stays at one copy of the base: the reload streams into the live parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from mint_store.format.hashing import content_id
from tools._repo import ROOT

SAFETENSORS_NAME = "model.safetensors"


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn``."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- the base --------------------------------------------------------------------------------


def save_base(params: dict[str, torch.Tensor], config: Any, directory: Path) -> Path:
    """``model.safetensors`` (each storage once) + ``config.json``: a model dir vLLM can load."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SAFETENSORS_NAME
    save_file({k: v.detach() for k, v in params.items()}, str(path), metadata={"format": "pt"})  # no copy
    config.save_pretrained(str(directory))
    return path


def reload_safetensors(params: dict[str, torch.Tensor], path: Path, *, group_bytes: int = 2**30) -> None:
    """Every tensor of ``path`` into the parameter of its name, one at a time.

    The file is reopened every ``group_bytes``: ``safe_open`` maps it, and the pages read stay
    in the process's resident set until it is closed (a second base's worth at the end).
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = params[name].numel() * params[name].element_size()
        if groups[-1] and size + n > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    with torch.no_grad():
        for group in groups:
            with safe_open(str(path), framework="pt") as f:
                for name in group:
                    params[name].copy_(f.get_tensor(name))


def reload_raw(params: dict[str, torch.Tensor], path: Path) -> None:
    """The same bytes read straight into the parameters' memory (the floor of any reload)."""
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
        fd = fh.fileno()
        start = 8 + n
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            lo, hi = spec["data_offsets"]
            # numpy's stubs do not declare the buffer protocol
            dst = memoryview(cast(Any, params[name].detach().view(-1).view(torch.uint8).numpy())).cast("B")
            if len(dst) != hi - lo:
                raise ValueError(f"{name}: {hi - lo} bytes in the file, {len(dst)} in the model")
            _pread_all(fd, dst, start + lo)


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            raise EOFError("file shorter than its header says")
        got += n


# -- PEFT ------------------------------------------------------------------------------------


class PeftSwitcher:
    """A PeftModel over the base (wrapped once, untimed); :meth:`switch` is the timed part."""

    def __init__(self, model: nn.Module, first_dir: Path) -> None:
        from peft import PeftModel

        self.model = PeftModel.from_pretrained(model, str(first_dir), adapter_name="first")
        self._n = 0

    def switch(self, adapter_dir: Path) -> str:
        """``load_adapter`` + ``set_adapter``, as a server with PEFT switches (defaults kept)."""
        self._n += 1
        name = f"a{self._n}"
        self.model.load_adapter(str(adapter_dir), adapter_name=name)
        self.model.set_adapter(name)
        return name

    def drop(self, name: str) -> None:
        self.model.set_adapter("first")
        self.model.delete_adapter(name)

    def times(self, adapter_dir: Path, repeat: int) -> list[float]:
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            name = self.switch(adapter_dir)
            out.append(time.perf_counter() - t0)
            self.drop(name)
        return out

    def unload(self) -> nn.Module:
        return self.model.unload()


def peft_hotswap_times(model: nn.Module, adapter_dir: Path, repeat: int) -> list[float]:
    """Seconds of PEFT's fastest switch, ``hotswap_adapter``: the weights of ``adapter_dir`` copied
    into the modules of an adapter of the same rank and targets already loaded (the wrapping is
    untimed, as the engine's slots are made before its switches). The model is unwrapped after."""
    from peft import PeftModel
    from peft.utils.hotswap import hotswap_adapter

    peft_model = PeftModel.from_pretrained(model, str(adapter_dir), adapter_name="default")
    try:
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            hotswap_adapter(peft_model, str(adapter_dir), adapter_name="default")
            out.append(time.perf_counter() - t0)
        return out
    finally:
        peft_model.unload()


# -- the bytes of one row ----------------------------------------------------------------------


def byte_work(rows: list[tuple[str, int, int]], layout_id: str, *, spread: int = 64 * 2**20) -> dict[str, list[float]]:
    """Seconds of the byte work of switches, without the switch: for each row ``(file, offset,
    length)`` (the rows the cold switches read, in order), ``os.preadv`` into a host buffer,
    hash it, copy it into a slot-sized destination (``pread``, ``hash``, ``memcpy``); then
    copies alternating between two buffers (``memcpy_warm``, as a warm switch's).

    The host buffers rotate over ``spread`` bytes (twice a large last-level cache), as rows
    land all over a serving engine's host cache: reads into two hot buffers would be
    faster than any switch's.
    """
    from engine_client.stream.host_pool import HostPool

    length = rows[0][2]
    nbuf = max(2, min(len(rows), -(-spread // length)))
    # the engine's own kinds of memory: a host pool's buffers (shared anonymous pages; numpy's
    # large arrays get transparent huge pages, which copy ~20% faster here) and a device
    # pool's [slots, S] tensor
    pool = HostPool(nbuf * HostPool(1).footprint(length), pin=False)
    pool.tensor.fill_(1)  # touched: no page faults in the timing
    bufs = [pool.try_acquire(length) for _ in range(nbuf)]
    views = [memoryview(cast(Any, b.array)) for b in bufs if b is not None]
    srcs = [b.tensor for b in bufs if b is not None]
    dst = torch.zeros(1, length, dtype=torch.uint8)[0]
    out: dict[str, list[float]] = {"pread": [], "hash": [], "memcpy": [], "memcpy_warm": []}
    fds: dict[str, int] = {}
    try:
        for i, (path, offset, n) in enumerate(rows):
            if n != length:
                raise ValueError("rows of one layout have one length")
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            k = i % nbuf
            t0 = time.perf_counter()
            _pread_all(fd, views[k], offset)
            t1 = time.perf_counter()
            content_id(layout_id, views[k])
            t2 = time.perf_counter()
            dst.copy_(srcs[k])
            t3 = time.perf_counter()
            out["pread"].append(t1 - t0)
            out["hash"].append(t2 - t1)
            out["memcpy"].append(t3 - t2)
        for i in range(2 * len(rows)):
            t0 = time.perf_counter()
            dst.copy_(srcs[i % 2])
            out["memcpy_warm"].append(time.perf_counter() - t0)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


# -- vLLM ------------------------------------------------------------------------------------


def vllm_python(explicit: str | None) -> tuple[str | None, str]:
    """(interpreter that has vLLM, why): this one if it imports vllm, else ``explicit``."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, "vLLM is installed here"
    if explicit:
        probe = subprocess.run([explicit, "-c", "import vllm"], capture_output=True, timeout=300)
        if probe.returncode == 0:
            return explicit, f"vLLM from {explicit}"
        return None, f"{explicit} cannot import vllm"
    return None, "vLLM is not installed in this environment (pass --vllm-python to use another one)"


def vllm_add_lora(python: str, model_dir: Path, loras: dict[str, Path], *, repeat: int, max_rank: int,
                  dtype: str, moe: bool, timeout: float) -> dict[str, Any]:
    """Run :mod:`tools.bench.swap_vllm` in ``python``; its JSON, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="mint-vllm-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": str(model_dir), "loras": {k: str(v) for k, v in loras.items()},
                                    "repeat": repeat, "max_lora_rank": max_rank, "dtype": dtype, "moe": moe}))
        try:
            proc = subprocess.run([python, "-m", "tools.bench.swap_vllm", str(spec), str(out)],
                                  capture_output=True, text=True, timeout=timeout,
                                  cwd=str(ROOT))
        except subprocess.TimeoutExpired:
            return {"error": f"vLLM run over {timeout:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
            return {"error": f"vLLM run failed (exit {proc.returncode}): " + " | ".join(tail)}
        result: dict[str, Any] = json.loads(out.read_text())
        return result
