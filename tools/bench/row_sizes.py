"""The command line both row-size benchmarks share (``tools/bench_row_alignment.py``,
``tools/bench_row_buffers.py``): ``--sizes`` (row bytes; default the r16 and r64 rows of
``tools/bench_vllm.py``), a repeat count, ``--out``; each size measured in a temporary directory,
one line printed per size, the results written as JSON under one key; and the row both read
(:func:`shard_row`)."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mint_store.format.hashing import content_id
from mint_store.results import Location
from mint_store.storage import LocalStorage

LAYOUT = "0123456789abcdef" * 2  # (a layout id: only the content id's hash reads it)
VLLM_ROWS = "9306560,37224896"  # tools/bench_vllm.py's r16 and r64 rows


def shard_row(size: int, root: Path) -> tuple[LocalStorage, Location, np.ndarray]:
    """A row of ``size`` random bytes, alone at offset 0 of a shard file under ``root`` (a
    page-aligned offset, as every large row's is): its storage, its location, its bytes."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)  # [size]
    storage = LocalStorage(root / f"s{size}")
    storage.put("packs/p", data.tobytes())
    return storage, Location(content_id(LAYOUT, data), LAYOUT, "packs/p", 0, size, 0), data


def run_sizes(argv: list[str] | None, doc: str | None, *, key: str, repeat: tuple[str, int, str],
              measure: Callable[[int, int, Path], dict[str, Any]], line: Callable[[dict[str, Any]], str]) -> int:
    """Parse ``argv``, run ``measure(size, repeats, tmp)`` for each size, print ``line(result)``
    for each; ``repeat`` is the repeat flag's (name, default, help)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=VLLM_ROWS,
                   help="row bytes, comma-separated (default: tools/bench_vllm.py's r16 and r64 rows)")
    flag, default, help_ = repeat
    p.add_argument(flag, type=int, default=default, dest="repeats", help=help_)
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",") if s]
    if not sizes or min(sizes) <= 0 or a.repeats < 1:
        p.error(f"--sizes must be positive byte counts and {flag} at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(n, a.repeats, Path(tmp)) for n in sizes]
    for r in results:
        print(line(r))
    if a.out:
        Path(a.out).write_text(json.dumps({key: results}, indent=1))
    return 0
