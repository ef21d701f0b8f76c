"""Re-measure some rows of a mixed-batch results file with more rounds, in place.

A full ``bench_batch.py --part peer`` run gives each (family, shape, N) the same time budget, so
its slowest rows (N = 256 prefill: a ~2.5 s base forward) get few paired rounds and their
overheads stay within noise. ``--peer-update FILE`` runs only the rows asked for, with the budget
asked for, and writes ``FILE`` back with those rows in place of its rows of the same family,
shape and N; every other row, and the file's own run details, stay as they were. Each row put in
records the run it came from (``row["run"]``: its command, time and round budget), and the
report names that run beside the row's figures.

Rows are comparable only when measured on the same model and threads: a run whose settings
differ from the file's in anything but the rows and the round budget is refused before it starts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

# the settings a row's figures depend on (counts, shapes, families, rounds and budget may differ)
SAME_SETTINGS = ("hidden", "layers", "intermediate", "vocab", "rank", "tokens", "experts", "top_k",
                 "moe_intermediate", "threads", "device", "peft_max_n")


def load(path: str | Path) -> dict[str, Any]:
    """A mixed results file as written by the bench; ValueError naming the file if it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--peer-update {path}: not a readable results file ({e})") from e
    if doc.get("benchmark") != "mixed" or "rows" not in doc.get("results", {}):
        raise ValueError(f"--peer-update {path}: not written by bench_batch.py --part peer "
                         f"(benchmark {doc.get('benchmark')!r})")
    return doc


def check_settings(doc: dict[str, Any], config: dict[str, Any]) -> None:
    """ValueError listing every setting in which ``config`` (a run's) differs from ``doc``'s run."""
    old = doc["results"]["config"]
    differ = [f"{k} {old.get(k)!r} there, {config.get(k)!r} here" for k in SAME_SETTINGS if old.get(k) != config.get(k)]
    if differ:
        raise ValueError("rows of a run with other settings would not compare with the file's: " + "; ".join(differ))


def check_threads(doc: dict[str, Any], torch_threads: int) -> None:
    """ValueError unless this run's torch threads are the file's (checked before the run: the
    threads a run gets are only known for certain once torch is set up, and merge checks again)."""
    there = doc["results"]["torch_threads"]
    if there != torch_threads:
        raise ValueError(f"torch would run {torch_threads} threads here, {there} there (pass --threads {there})")


def merge(doc: dict[str, Any], new: dict[str, Any], *, command: str, written: str | None = None) -> dict[str, Any]:
    """``doc`` with ``new``'s rows (a run's results) in place of its rows of the same family,
    shape and N, each marked with that run; rows ``doc`` lacks are appended. ``doc`` is not changed."""
    check_settings(doc, new["config"])
    if new["torch_threads"] != doc["results"]["torch_threads"]:
        raise ValueError(f"torch ran {new['torch_threads']} threads here, {doc['results']['torch_threads']} there")
    c = new["config"]
    written = written or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run = {"command": command, "time": written, "budget_s": c["budget_s"], "max_rounds": c["max_rounds"],
           "machine": new["machine"]}
    fresh = {_key(r): r | {"run": run} for r in new["rows"]}
    rows = [fresh.pop(_key(r), r) for r in doc["results"]["rows"]]
    out = dict(doc)
    out["results"] = doc["results"] | {"rows": rows + list(fresh.values())}
    return out


def _key(row: dict[str, Any]) -> tuple[str, str, int]:
    return row.get("family", "dense"), row["shape"], row["n"]


def write(path: str | Path, doc: dict[str, Any]) -> None:
    """Replace the file at ``path`` with ``doc``, whole or not at all (it holds hours of runs)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, target)
