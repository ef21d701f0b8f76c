"""The paths this plugin hands vLLM as ``lora_path``, and the content id each names.

Both are functions of the content alone (vLLM keys its prefix cache on a LoRA's name and
path: a moved tag gets another path, never the old content's KV):

- ``<cache dir>/rows/<content id>``: a *row path* (:mod:`.direct`), never created on disk;
- ``<cache dir>/entries/<content id>``: a PEFT directory of the files path (:mod:`.cache`).

Beside them, ``<cache dir>/warm/<digest of a side name>``: a marker the worker writes once the
chores of the load under that side name (content warmed ahead of a tag's switch, a name of its
own each time: :func:`.preload.warm_name`) are done; :mod:`.preload` waits for it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mint_store.format.names import check_content_id

ROWS = "rows"  # <cache dir>/rows/<content id>: a row path (never created)
ENTRIES = "entries"  # <cache dir>/entries/<content id>: a PEFT directory of the files path (cache.py)
WARM = "warm"  # <cache dir>/warm/<digest of a side name>: a warm load's chores are done (preload.py)


def row_path(cache_dir: Path, content_id: str) -> str:
    return str(cache_dir / ROWS / check_content_id(content_id))


def warm_marker(cache_dir: Path, side_name: str) -> Path:
    return cache_dir / WARM / hashlib.sha256(side_name.encode()).hexdigest()[:32]


def content_of(cache_dir: Path, path: str) -> tuple[str, bool] | None:
    """``(content id, is a row path)`` of a path this plugin handed vLLM; None for any other."""
    p = Path(path)
    if p.parent.parent != cache_dir or p.parent.name not in (ROWS, ENTRIES):
        return None
    try:
        return check_content_id(p.name), p.parent.name == ROWS
    except ValueError:
        return None
