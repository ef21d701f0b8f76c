"""Tables, percentiles, JSON results and config checks shared by the benchmarks."""

from __future__ import annotations

import contextlib
import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def percentiles(samples_ns: Sequence[int] | np.ndarray, ps: Sequence[float] = (50, 90, 99, 99.9)) -> dict[str, float]:
    """Percentiles in microseconds."""
    arr = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {f"p{p:g}": float(np.percentile(arr, p)) for p in ps} | {"mean": float(arr.mean())}


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}\n" + "-" * (width + 30))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def write_json(path: str | Path, name: str, results: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": run_command(),
           "machine": {"python": platform.python_version(), "processor": platform.machine(),
                       "cpus": __import__("os").cpu_count()},
           "results": results}
    out.write_text(json.dumps(doc, indent=2))
    return out


def run_command() -> str:
    """How this process was started (``python tools/x.py --args``), to say what produced a file."""
    import shlex
    import sys

    tool = Path(sys.argv[0])
    with contextlib.suppress(ValueError):
        tool = tool.resolve().relative_to(Path(__file__).resolve().parents[2])
    return shlex.join(["python", str(tool), *sys.argv[1:]])


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def require_positive(cfg: Any, *names: str) -> None:
    """ValueError naming the first of ``cfg``'s fields ``names`` below 1."""
    for name in names:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(cfg, name)}")
