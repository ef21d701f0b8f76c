"""The packages are rooms: each says what it holds and exports its names, no two modules
import each other (at any depth), and importing one small module stays light."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tools.check_imports import check

ROOT = Path(__file__).parents[1]
PACKAGES = sorted(
    ".".join(p.parent.relative_to(ROOT).parts)
    for top in ("mint_store", "engine_client")
    for p in (ROOT / top).rglob("__init__.py")
)


def test_no_module_pair_imports_each_other_and_the_core_never_imports_the_client() -> None:
    limit = sys.getrecursionlimit()
    _, found, wrong = check(["engine_client", "mint_store", "tools"])
    assert found == [] and wrong == []
    assert sys.getrecursionlimit() == limit  # left as it was: parsers in this process rely on it


def test_the_checker_counts_imports_inside_functions_and_under_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "mint_store"  # (named so that the core -> client rule applies too)
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    (pkg / "c.py").write_text("from .d import x\n")
    (pkg / "d.py").write_text("x = 1\n")
    (pkg / "e.py").write_text("def g():\n    import engine_client.thing\n")
    (tmp_path / "engine_client").mkdir()
    (tmp_path / "engine_client" / "__init__.py").write_text("")
    (tmp_path / "engine_client" / "thing.py").write_text("")
    edges, found, wrong = check(["mint_store", "engine_client"], tmp_path)
    assert found == [["mint_store.a", "mint_store.b"]]  # c -> d is one way: fine
    assert edges["mint_store.c"] == {"mint_store.d"}
    assert wrong == [("mint_store.e", "engine_client.thing")]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_says_what_it_holds_and_its_names_resolve(package: str) -> None:
    mod = importlib.import_module(package)
    doc = (mod.__doc__ or "").strip()
    assert doc and len(doc.splitlines()[0]) > 20, f"{package}/__init__.py: say in two lines what it holds"
    for name in getattr(mod, "__all__", []):
        value = getattr(mod, name)
        # a public name, not a submodule that shadowed it
        assert not isinstance(value, type(sys)) or name == "errors", (package, name)
    exports = getattr(mod, "_EXPORTS", {})
    for name, where in exports.items():
        assert getattr(mod, name) is getattr(importlib.import_module(where, package), name), (package, name)
        assert not (ROOT / package.replace(".", "/") / f"{name}.py").exists(), (package, name)


@pytest.mark.parametrize("module", ["mint_store.format.wire", "mint_store.format.names", "engine_client.errors",
                                    "mint_store.index", "mint_store.write", "engine_client.kernels"])
def test_importing_one_small_module_or_a_package_stays_light(module: str) -> None:
    code = (
        "import sys\n"
        f"import {module}\n"
        "heavy = {'torch', 'zarr', 'lmdb', 'aiohttp', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
