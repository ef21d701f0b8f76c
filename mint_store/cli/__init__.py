"""The ``mint`` command line (``mint_store.cli:main``): store commands, and the maintenance
commands of :mod:`.commands.admin`. Its spellings are a public surface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .admin import run_admin
    from .commands import build_parser, main

_EXPORTS = {
    "build_parser": ".commands",
    "main": ".commands",
    "run_admin": ".admin",
}

__all__ = [
    "build_parser",
    "main",
    "run_admin",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
