"""A package's public names, imported on first use (PEP 562).

Every package of ``mint_store`` and ``engine_client`` exports its names this way, so that
importing one small module (``mint_store.format.wire``, say) loads its package's
``__init__`` without pulling in torch, zarr, lmdb or aiohttp through its siblings.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each public name to the
    module (relative to the package) that defines it. Never map a name to a submodule of the
    same name: importing that submodule would replace the attribute."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
