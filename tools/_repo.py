"""The repository root, and the root on ``sys.path``.

``python tools/bench_batch.py`` puts ``tools/`` on ``sys.path``, not the repository root, so a
program there imports this module first (``import _repo``) and can then import ``tools.bench``.
The root is found by walking up from this file to the folder holding ``pyproject.toml``: the
one place that knows where the repository starts.
"""

from __future__ import annotations

import sys
from pathlib import Path


def repo_root() -> Path:
    """The folder above this file that holds ``pyproject.toml``.

    Raises
    ------
    RuntimeError
        If no such folder exists (the tools were copied out of the repository).
    """
    here = Path(__file__).resolve().parent
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    raise RuntimeError(f"no pyproject.toml above {here}: run the tools from a checkout of the repository")


ROOT = repo_root()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
