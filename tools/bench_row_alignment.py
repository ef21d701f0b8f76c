#!/usr/bin/env python3
"""Where a large row lands (not a test): the verified read into a destination that starts on a
page, as a new one does (``mint_store.read.empty_row``), against one 16 bytes past a page, as
a large ``numpy.empty`` lies, and a raw ``preadv`` on one thread in the same run.

    python tools/bench_row_alignment.py --sizes 9306560,37224896

Each row sits at a page-aligned offset of a shard file (page cache warm), as a row
may (1 in 64 of 64-byte aligned offsets). Per size, the median of ``--reads`` reads of:

* ``fresh``: a new destination per read, as ``Store.read_row(loc)`` gives one (its page faults
  included): ``numpy.empty`` against ``empty_row``;
* ``reused``: one destination, already faulted in, placed 16 bytes past a page against on one;
* ``raw``: the machine's limit on one thread: ``os.preadv`` of the same bytes, no hash, into a
  faulted-in destination placed as the row is in its page (the kernel's copy at its fastest;
  ``tools/bench/read_floor.py``). The verified read uses several threads on a large row, so it
  can beat this: its speed is reported as a multiple of the raw read's.

The kernel's copy (``rep movsb``) slows several-fold where the destination lies 1 to 31 bytes
past the source modulo 4 KiB (``mint_store/read/buffers.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import _repo  # noqa: F401  (puts the repository root on sys.path)
import numpy as np

from mint_store.read import empty_row, read_verified
from tools.bench.read_floor import median_ms, page_matched, preadv_all
from tools.bench.row_sizes import run_sizes, shard_row


def measure(size: int, reads: int, root: Path) -> dict[str, Any]:
    storage, loc, data = shard_row(size, root)
    # reused destinations, faulted in (tools/bench/read_floor.py): one on a page (as the row is
    # in its file), one 16 bytes past a page
    _, page_view = page_matched(size, loc.offset)  # (the views keep their mappings alive)
    _, view16 = page_matched(size, loc.offset + 16)
    on_page, past16 = np.frombuffer(page_view, np.uint8), np.frombuffer(view16, np.uint8)  # [size] each
    path = storage.local_path("packs/p")
    assert path is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        out = {
            "fresh_numpy_empty_ms": median_ms(lambda: read_verified(storage, loc, np.empty(size, np.uint8)), reads),
            "fresh_empty_row_ms": median_ms(lambda: read_verified(storage, loc, empty_row(size)), reads),
            "reused_16_past_page_ms": median_ms(lambda: read_verified(storage, loc, past16), reads),
            "reused_on_page_ms": median_ms(lambda: read_verified(storage, loc, on_page), reads),
            "raw_preadv_ms": median_ms(lambda: preadv_all(fd, page_view, loc.offset), reads),
        }
        if not np.array_equal(on_page, data):
            raise AssertionError("the row read back is not the row written")
    finally:
        os.close(fd)  # (the mappings go with the last views of them)
    return out | {"bytes": size, "fresh_gain": out["fresh_numpy_empty_ms"] / out["fresh_empty_row_ms"],
                  "reused_gain": out["reused_16_past_page_ms"] / out["reused_on_page_ms"],
                  "on_page_speed_vs_raw": out["raw_preadv_ms"] / out["reused_on_page_ms"]}


def _line(r: dict[str, Any]) -> str:
    return (f"{r['bytes']:>11,} B  fresh: numpy.empty {r['fresh_numpy_empty_ms']:6.2f} ms, empty_row "
            f"{r['fresh_empty_row_ms']:6.2f} ms ({r['fresh_gain']:.2f}x)   reused: 16 past a page "
            f"{r['reused_16_past_page_ms']:6.2f} ms, on a page {r['reused_on_page_ms']:6.2f} ms "
            f"({r['reused_gain']:.2f}x)   raw preadv (one thread, no hash) {r['raw_preadv_ms']:6.2f} ms: the "
            f"read on a page at {r['on_page_speed_vs_raw']:.2f}x its speed")


def main(argv: list[str] | None = None) -> int:
    return run_sizes(argv, __doc__, key="row_alignment", measure=measure, line=_line,
                     repeat=("--reads", 15, "reads per measure (the median counts)"))


if __name__ == "__main__":
    raise SystemExit(main())
