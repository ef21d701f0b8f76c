"""What a new user of ``mint`` meets first: listing through a server, messages that say what
to do, readable times, one exit code for errors, and README examples that work as written."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from mint_store.cli.commands import main
from mint_store.service import ServerThread, ServiceConfig
from tests.support.cli import run
from tests.support.hf_models import make_peft_dir

ROOT = Path(__file__).resolve().parents[1]
ADMIN, ACME, BOTH = "usability-admin-token-01", "usability-acme-token-002", "usability-reader-token-03"


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    return make_peft_dir(tmp_path / "peft", "llama", seed=0, r=4, lora_alpha=8, target_modules=["q_proj"])


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerThread]:
    for var in ("MINT_SERVER", "MINT_TOKEN", "MINT_STORE"):
        monkeypatch.delenv(var, raising=False)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [
        {"token": ADMIN, "tenants": [], "role": "admin"},
        {"token": ACME, "tenants": ["acme"], "role": "write"},
        {"token": BOTH, "tenants": ["beta", "acme"], "role": "read"}]}))
    srv = ServerThread(ServiceConfig(store=str(tmp_path / "served"), port=0, tokens_file=str(tokens),
                                     auto_compact=False))
    yield srv
    srv.stop()


def test_ls_through_a_server_lists_the_tenants_the_token_sees(capsys, server: ServerThread,
                                                               adapter_dir: Path) -> None:
    for tenant in ("acme", "gamma"):
        code, _, err = run(capsys, "publish", str(adapter_dir), "--name", f"{tenant}/chat", "--server", server.url,
                           "--token", ADMIN)
        assert code == 0, err
    code, out, err = run(capsys, "ls", "--server", server.url, "--token", ADMIN, "--json")
    assert code == 0 and json.loads(out) == ["acme", "gamma"], err  # admin: every tenant with an adapter
    code, out, _ = run(capsys, "ls", "--server", server.url, "--token", BOTH, "--json")
    assert json.loads(out) == ["acme", "beta"]  # a tenant token: its own tenants, and nothing of gamma
    code, out, _ = run(capsys, "ls", "--server", server.url, "--token", ACME)
    assert (code, out) == (0, "acme\n")


def test_missing_token_error_names_the_flag_and_the_variable(capsys, server: ServerThread) -> None:
    code, out, err = run(capsys, "ls", "acme", "--server", server.url)
    assert (code, out) == (1, "")
    assert "--token" in err and "MINT_TOKEN" in err


def test_a_directory_that_does_not_exist_is_reported_as_missing(capsys, tmp_path: Path,
                                                                server: ServerThread) -> None:
    missing = str(tmp_path / "no-such-adapter")
    for where in (["--store", str(tmp_path / "store")], ["--server", server.url, "--token", ACME]):
        code, out, err = run(capsys, "publish", missing, "--name", "acme/x", *where)
        assert (code, out) == (1, "")
        assert f"'{missing}' does not exist" in err and "adapter_config.json" not in err


def test_show_prints_iso_utc_and_json_keeps_epoch_seconds(capsys, tmp_path: Path, adapter_dir: Path) -> None:
    store = str(tmp_path / "store")
    assert run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--store", store)[0] == 0
    _, out, _ = run(capsys, "show", "acme/chat", "--store", store, "--json")
    created = json.loads(out)["created"]
    assert isinstance(created, float)
    _, out, _ = run(capsys, "show", "acme/chat", "--store", store)
    line = next(ln for ln in out.splitlines() if ln.startswith("created: "))
    shown = line.removeprefix("created: ")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", shown), line
    assert datetime.fromisoformat(shown) == datetime.fromtimestamp(int(created), UTC)


ERRORS = [
    ["serve", "--tokens", "{tmp}/no-token-file.json", "--port", "0"],  # was 2
    ["serve", "--host", "0.0.0.0", "--port", "0"],  # no token file off loopback; was 2
    ["show", "acme/x", "--store", "{tmp}/no-store"],
    ["show", "acme/..", "--store", "{tmp}/no-store"],
    ["publish", "{tmp}/nothing", "--name", "acme/x", "--store", "{tmp}/store"],
    ["stats", "--server", "http://127.0.0.1:9"],
    ["pull", "acme/x", "-o", "{tmp}/out", "--server", "http://127.0.0.1:9", "--token", "t" * 16],
]
USAGE = [["publish"], ["show", "acme/x", "--no-such-flag"], ["frobnicate"], ["ls", "--port"],
         # a negative or NaN grace would sweep shards readers still use (the HTTP route answers 400)
         ["sweep", "--grace", "-1"], ["sweep", "--grace", "nan"], ["compact", "--grace", "inf"],
         ["compact", "--min-live", "2"]]


def test_every_error_exits_1_and_usage_errors_exit_2(capsys, tmp_path: Path) -> None:
    for argv in ERRORS:
        code, out, err = run(capsys, *(a.format(tmp=tmp_path) for a in argv))
        assert (code, out) == (1, ""), (argv, code, err)
        assert err.startswith("mint: error:"), err
    from mint_store.service.__main__ import main as service_main

    assert service_main(["--tokens", str(tmp_path / "no-token-file.json"), "--port", "0"]) == 1  # was 2
    assert "mint: error: token file" in capsys.readouterr().err
    for argv in USAGE:  # argparse's convention, kept: 2 and its usage line
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert "usage: mint" in capsys.readouterr().err


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_says_how_to_reach_mint_and_what_exit_codes_mean() -> None:
    cli = _readme_section("The CLI")
    assert ". .venv/bin/activate" in cli and ".venv/bin/mint" in cli
    assert "exit code 1" in cli and "2 for a usage error" in cli and "3 when `mint fsck`" in cli


def test_readme_engine_example_closes_the_engine() -> None:
    engines = _readme_section("Engines")
    code = engines.split("```python\n", 1)[1].split("```", 1)[0]
    compile(code, "README-engines", "exec")
    assert re.search(r"^with LoRAEngine\(.*\) as engine:", code, re.M) or "engine.close()" in code
