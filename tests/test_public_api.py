"""The public API: ``from mint_store import ...`` gives every exported name, stays light to
import, and the README's Python examples use nothing else."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import mint_store

ROOT = Path(__file__).parents[1]


def test_every_exported_name_resolves_to_its_defining_module() -> None:
    assert set(mint_store.__all__) == set(mint_store._EXPORTS)
    for name in mint_store.__all__:
        module = importlib.import_module(mint_store._EXPORTS[name], "mint_store")
        assert getattr(mint_store, name) is getattr(module, name), name
    assert {"Store", "StoreConfig", "load_peft_dir", "VersionInfo", "MintError"} <= set(mint_store.__all__)
    # a name that is also a submodule would turn into the module once that is imported
    assert not [n for n in mint_store.__all__ if (ROOT / "mint_store" / f"{n}.py").exists()]


def test_the_crash_harness_is_not_public() -> None:
    assert "crash_at" not in mint_store.StoreConfig.__dataclass_fields__
    assert not any("crash" in name.lower() for name in mint_store.__all__)


def test_importing_the_value_objects_does_not_import_torch_zarr_or_lmdb() -> None:
    code = (
        "import sys\n"
        "from mint_store import Location, PublishResult, VersionInfo, MintError\n"
        "heavy = {'torch', 'zarr', 'lmdb'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_readme_python_examples_import_only_the_public_apis() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    imports = [line.strip() for block in blocks for line in block.splitlines() if "mint_store" in line
               and "import" in line]
    assert imports, "the README has a Python example of the store"
    for line in imports:
        assert line.startswith("from mint_store import "), line


def test_the_client_decodes_errors_without_importing_the_service_or_aiohttp() -> None:
    code = (
        "import sys\n"
        "from engine_client.errors import error_from_body, AdapterNotFound, Forbidden\n"
        "assert isinstance(error_from_body(404, {'error': 'adapter_not_found'}), AdapterNotFound)\n"
        "assert isinstance(error_from_body(403, {'error': 'forbidden'}), Forbidden)\n"
        "loaded = {m for m in sys.modules if m.startswith('mint_store.service') or m == 'aiohttp'}\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_core_package_never_imports_the_client_package() -> None:
    import ast

    offenders = []
    for path in sorted((ROOT / "mint_store").rglob("*.py")):
        if "bench" in path.relative_to(ROOT).parts:
            continue  # benchmark programs, on their way out of the package to tools/
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n.split(".")[0] == "engine_client" for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_cli_finds_its_remote_backend_as_a_plugin() -> None:
    from engine_client.client.cli_backend import RemoteBackend
    from mint_store.cli.commands import remote_backend

    backend = remote_backend("http://127.0.0.1:9", token=None)  # nothing is contacted until a command
    try:
        assert isinstance(backend, RemoteBackend)
    finally:
        backend.close()


class EchoBackend:
    def __init__(self, url: str, *, token: str | None) -> None:
        self.url, self.token = url, token


def test_an_installed_remote_backend_plugin_is_used(tmp_path: Path, monkeypatch) -> None:
    from mint_store.cli.commands import REMOTE_BACKEND_GROUP, remote_backend

    dist = tmp_path / "mint_echo_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mint-echo-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{REMOTE_BACKEND_GROUP}]\na_echo = test_public_api:EchoBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    backend = remote_backend("http://127.0.0.1:9", token="t")
    assert type(backend).__name__ == "EchoBackend" and (backend.url, backend.token) == ("http://127.0.0.1:9", "t")
