"""One figure of the benchmark suite's table: ours, the peer's, their ratio and the target.

Its own module: the suite (:mod:`.suite`) and the tools' measure builders (``*_measures.py``)
both use it, and the suite imports those builders.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Measure:
    key: str  # stable across runs: --compare matches on it
    title: str
    ours: float
    unit: str
    baseline: float | None = None
    baseline_label: str = ""
    ratio: float | None = None
    paper: str = ""
    target: str = ""
    met: bool | None = None
    higher_is_better: bool = True
    command: str = ""
    sizes: str = ""
    rerun: str = ""  # a later run that re-measured this figure alone, with more rounds (its command and time)
