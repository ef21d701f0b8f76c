"""Profiles of a benchmark's slow path, not of its setup.

A tool wraps the section a target measures in ``profiled("name")``. When the environment
names a file prefix in ``MINT_BENCH_PROFILE`` (``bench_all`` sets it on a separate run, so the
profiler never slows a timed figure), each section gets its own cProfile, written to
``<prefix>.<name>.prof`` when the section ends (repeated entries accumulate); otherwise
``profiled`` costs one environment lookup.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENV = "MINT_BENCH_PROFILE"

_PROFILES: dict[str, cProfile.Profile] = {}


def _file_name(section: str) -> str:
    # keep the name readable in the report: only what a file name cannot hold is replaced
    return re.sub(r"[/\x00]", "_", section)


@contextmanager
def profiled(section: str) -> Iterator[None]:
    prefix = os.environ.get(ENV)
    if not prefix:
        yield
        return
    prof = _PROFILES.setdefault(section, cProfile.Profile())
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(f"{prefix}.{_file_name(section)}.prof")


def summarise(prefix: str | Path, *, top: int = 12) -> dict[str, dict[str, Any]]:
    """Per section written under ``prefix``: total seconds and the top functions by own time."""
    prefix = Path(prefix)
    out: dict[str, dict[str, Any]] = {}
    for file in sorted(prefix.parent.glob(f"{prefix.name}.*.prof")):
        section = file.name[len(prefix.name) + 1 : -len(".prof")]
        stats = pstats.Stats(str(file))
        raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
        total = max(float(stats.total_tt), 1e-9)  # type: ignore[attr-defined]
        rows = [{"function": _where(filename, line, func), "calls": ncalls, "own_s": tottime,
                 "cumulative_s": cumtime, "share": tottime / total}
                for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in raw.items()]
        rows.sort(key=lambda r: -r["own_s"])
        out[section] = {"total_s": total, "functions": rows[:top]}
    return out


def _where(filename: str, line: int, func: str) -> str:
    if filename == "~":  # a builtin: the name says it all
        return func
    parts = Path(filename).parts
    # the package path tells ours (mint_store/..., engine_client/...) from torch's or the stdlib's
    short = "/".join(parts[-2:]) if len(parts) >= 2 else filename
    return f"{short}:{line}({func})"
