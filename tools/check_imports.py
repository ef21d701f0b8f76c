"""Report import cycles among the project's packages (exit status 1 if there is one).

    python tools/check_imports.py [package ...]      # default: engine_client mint_store tools

Builds the module import graph with :mod:`ast` (every ``import``/``from ... import`` in a
module, at any depth: a function-local import, or one under ``if TYPE_CHECKING:``, still ties
two modules together -- they are one concept split in two, or need a third module for what
they share) and prints its strongly connected components of more than one module. Also
checks the one-way rule: ``mint_store`` (the core) must never import ``engine_client``.
``make lint`` runs it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def graph(packages: list[str], root: Path = ROOT) -> dict[str, set[str]]:
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    edges: dict[str, set[str]] = {m: set() for m in files}

    def known(name: str) -> str | None:
        while name:  # a name inside a module (``from pkg.mod import thing``) counts as the module
            if name in files:
                return name
            name = name.rpartition(".")[0]
        return None

    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = resolve(mod, is_pkg, node)
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for t in targets:
                dep = known(t)
                if dep is not None and dep != mod:
                    edges[mod].add(dep)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()  # (restored: the tests run this in-process, beside parsers that rely on it)
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def _is_pkg_of(mod: str, dep: str) -> bool:
    """``dep`` is a package that contains ``mod`` (importing your own package's __init__
    is how Python loads a submodule anyway: not a cycle worth reporting)."""
    return mod.startswith(dep + ".")


def check(packages: list[str], root: Path = ROOT) -> tuple[dict[str, set[str]], list[list[str]], list[tuple[str, str]]]:
    """The import graph of ``packages`` under ``root``, its cycles, and the core's imports of the client."""
    edges = graph(packages, root)
    # a package's __init__ re-exporting its submodules, and the submodules importing
    # siblings through the package, is the one loop Python resolves by design: drop edges
    # from a module to the packages that contain it
    edges = {m: {d for d in deps if not _is_pkg_of(m, d)} for m, deps in edges.items()}
    wrong = sorted((m, d) for m, deps in edges.items() if m.startswith("mint_store") for d in deps
                   if d.startswith("engine_client"))
    return edges, cycles(edges), wrong


def main(argv: list[str]) -> int:
    packages = argv or ["engine_client", "mint_store", "tools"]
    edges, found, wrong = check(packages)
    bad = 0
    for comp in found:
        bad += 1
        print(f"cycle ({len(comp)} modules): " + ", ".join(comp))
        inside = set(comp)
        for m in comp:
            for d in sorted(edges[m] & inside):
                print(f"    {m} -> {d}")
    for m, d in wrong:
        bad += 1
        print(f"core imports the client: {m} -> {d}")
    n_edges = sum(len(d) for d in edges.values())
    print(f"{len(edges)} modules, {n_edges} imports in {', '.join(packages)}: "
          f"{len(found)} cycles, {len(wrong)} core->client imports")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
