"""The ``mint`` command line: exact spellings, JSON output, exit codes, PEFT round trip."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.cli import run
from tests.support.hf_models import load_peft, logits, make_peft_dir


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    return make_peft_dir(tmp_path / "peft", "llama", seed=0, r=4, lora_alpha=8,
                         target_modules=["q_proj", "v_proj", "down_proj"])


def test_publish_pull_round_trip_gives_identical_logits(capsys, tmp_path: Path, adapter_dir: Path) -> None:
    store = str(tmp_path / "store")
    code, out, _ = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--tag", "prod",
                       "--store", store, "--json")
    assert code == 0
    pub = json.loads(out)
    assert {"tenant", "name", "version", "content_id", "layout_id", "nbytes", "deduplicated"} <= pub.keys()
    assert (pub["tenant"], pub["name"], pub["version"], pub["deduplicated"]) == ("acme", "chat", 1, False)
    code, out, _ = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--store", store, "--json")
    again = json.loads(out)
    assert again["version"] == 2 and again["deduplicated"] and again["content_id"] == pub["content_id"]

    code, out, _ = run(capsys, "show", "acme/chat:prod", "--store", store, "--json")
    shown = json.loads(out)
    assert {k: shown[k] for k in ("tenant", "name", "version", "content_id", "layout_id", "nbytes")} == {
        k: pub[k] for k in ("tenant", "name", "version", "content_id", "layout_id", "nbytes")}
    assert shown["tags"] == ["prod"]

    out_dir = tmp_path / "pulled"
    code, _, _ = run(capsys, "pull", "acme/chat:prod", "-o", str(out_dir), "--store", store)
    assert code == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    original, pulled = load_peft(adapter_dir, "llama"), load_peft(out_dir, "llama")
    assert torch.equal(logits(original), logits(pulled))


def test_ls_tag_rm(capsys, tmp_path: Path, adapter_dir: Path) -> None:
    store = str(tmp_path / "store")
    for name in ("acme/a", "acme/b", "beta/c"):
        assert run(capsys, "publish", str(adapter_dir), "--name", name, "--store", store)[0] == 0
    code, out, _ = run(capsys, "ls", "--store", store, "--json")
    assert json.loads(out) == ["acme", "beta"]
    code, out, _ = run(capsys, "ls", "acme", "--store", store, "--json")
    assert [i["name"] for i in json.loads(out)] == ["a", "b"]
    code, out, _ = run(capsys, "tag", "acme/a@1", "canary", "--store", store, "--json")
    assert json.loads(out) == {"tenant": "acme", "name": "a", "version": 1, "tag": "canary"}
    code, out, _ = run(capsys, "rm", "acme/a@1", "--store", store, "--json")
    assert json.loads(out)["deleted"] is True
    code, out, err = run(capsys, "show", "acme/a:canary", "--store", store)
    assert code == 1 and "no tag" in err and out == ""


@pytest.mark.parametrize("argv", [["fsck", "--no-progress"], ["stats"], ["compact"], ["sweep"], ["reindex"],
                                  ["ls"], ["show", "acme/a"]])
@pytest.mark.parametrize("where", ["missing", "not a store"])
def test_a_path_that_holds_no_store_is_an_error_and_nothing_is_created(capsys, tmp_path: Path, argv: list[str],
                                                                       where: str) -> None:
    """A mistyped --store is not a new, empty, "clean" store: reading and admin commands
    create nothing there (fsck used to answer clean, exit 0, on a store it had just made)."""
    target = tmp_path / "typo" / "store"
    if where == "not a store":
        target.mkdir(parents=True)
        (target / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out, err = run(capsys, *argv, "--store", str(target))
    assert code != 0 and out == "" and "no store at" in err and "mint publish" in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["show", "acme/..", "--store", "{store}"], "invalid name"),
        (["show", "acme/missing", "--store", "{store}"], "no store at"),
        (["publish", "{missing}", "--name", "acme/x", "--store", "{store}"], "does not exist"),
        (["publish", "{adapter}", "--name", "acme", "--store", "{store}"], "TENANT/NAME"),
        (["tag", "acme/x@0", "prod", "--store", "{store}"], "versions are integers"),
    ],
)
def test_errors_go_to_stderr_with_nonzero_exit(capsys, tmp_path: Path, adapter_dir: Path, argv, message) -> None:
    store = tmp_path / "store"
    argv = [a.format(store=store, missing=tmp_path / "nope", adapter=adapter_dir) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code != 0 and out == "" and err.startswith("mint: error:") and message in err


def test_console_script_and_environment_defaults(tmp_path: Path, adapter_dir: Path) -> None:
    env = {"MINT_STORE": str(tmp_path / "envstore"), "PATH": str(Path(sys.executable).parent)}
    mint = str(Path(sys.executable).parent / "mint")
    done = subprocess.run([mint, "publish", str(adapter_dir), "--name", "acme/env", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["version"] == 1
    assert (tmp_path / "envstore" / "index").is_dir()  # the index of a local store lives in <store>/index
    bad = subprocess.run([mint, "show", "acme/none"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 1 and "no adapter" in bad.stderr


def test_admin_commands(capsys, tmp_path: Path) -> None:
    from mint_store.store import Store
    from tests.support.factories import random_adapter

    store_dir = str(tmp_path / "store")
    with Store.open(store_dir) as store:
        for i in range(4):
            store.publish("acme", f"a{i}", random_adapter(i))
        store.delete("acme/a0")
    code, out, _ = run(capsys, "stats", "--store", store_dir, "--json")
    assert code == 0 and json.loads(out)["shards"] == 4
    code, out, _ = run(capsys, "compact", "--store", store_dir, "--json", "--grace", "0")
    report = json.loads(out)
    assert code == 0 and report["shards_after"] == 1 and report["rows_moved"] == 3 and len(report["swept"]) == 4
    code, out, _ = run(capsys, "fsck", "--store", store_dir, "--json")
    assert code == 0 and json.loads(out)["clean"] is True
    (tmp_path / "store" / "packs" / "stray").mkdir()
    (tmp_path / "store" / "packs" / "stray" / ".x.tmp").write_bytes(b"half-written")
    code, out, err = run(capsys, "fsck", "--store", store_dir, "--json")
    assert code == 3 and json.loads(out)["orphans"] == ["packs/stray/.x.tmp"] and "--repair" in err
    code, out, _ = run(capsys, "fsck", "--repair", "--store", store_dir, "--json")
    assert code == 0 and json.loads(out)["removed"] == ["packs/stray/.x.tmp"]
    code, out, _ = run(capsys, "reindex", "--store", store_dir, "--json")
    assert code == 0 and json.loads(out)["blobs"] == 3
    code, out, _ = run(capsys, "show", "acme/a3", "--store", store_dir, "--json")
    assert code == 0 and json.loads(out)["version"] == 1


def test_fsck_answers_the_same_with_and_without_repair_once_rows_are_quarantined(capsys, tmp_path: Path) -> None:
    """A quarantined row is nothing --repair can change: both modes list it as held and exit 4, and
    neither advises --repair; a foreign dot-file is not an orphan of the store's. (Before, fsck
    exited 3 advising --repair, --repair exited 0 and hid the row, and fsck exited 3 again.)"""
    from mint_store.store import Store
    from tests.support.factories import corrupt_byte, random_adapter

    store_dir = str(tmp_path / "store")
    with Store.open(store_dir) as store:
        store.publish("acme", "bad", random_adapter(1))
        store.publish("acme", "good", random_adapter(2))
        loc = store.resolve("acme/bad")
        corrupt_byte(store.storage, loc.shard_key, loc.offset + 3)
    (tmp_path / "store" / "packs" / ".DS_Store").write_bytes(b"finder")
    code, out, err = run(capsys, "fsck", "--store", store_dir, "--json")
    assert code == 3 and json.loads(out)["damaged"][0]["adapters"] == ["acme/bad@1"] and "--repair" in err
    assert json.loads(out)["orphans"] == []
    for argv in (["fsck", "--repair"], ["fsck", "--repair"], ["fsck"]):
        code, out, err = run(capsys, *argv, "--store", store_dir, "--json")
        report = json.loads(out)
        assert code == 4 and report["clean"] is True and report["damaged"] == []
        assert [d["adapters"] for d in report["held"]] == [["acme/bad@1"]]
        assert "--repair" not in err and "published again" in err
    assert (tmp_path / "store" / "packs" / ".DS_Store").exists()


def test_pull_of_a_tag_moved_while_it_reads_writes_and_reports_one_version(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolved once: the row, the config and the version reported all of the tag's version when
    the pull began (the tag moved after the row was read gave v1's weights with v2's config, or
    reported v2 over v1's files)."""
    from mint_store.cli.commands import LocalBackend
    from mint_store.peft.directory import load_peft_dir

    d1 = make_peft_dir(tmp_path / "v1", seed=1, r=2, lora_alpha=4)
    d2 = make_peft_dir(tmp_path / "v2", seed=2, r=2, lora_alpha=16)  # another scaling
    backend = LocalBackend(str(tmp_path / "store"), str(tmp_path / "index"), write=True)
    try:
        store = backend.store
        store.publish("acme", "chat", load_peft_dir(d1), tag="prod")
        store.publish("acme", "chat", load_peft_dir(d2))
        read = store.read

        def read_then_move(*args: object, **kwargs: object) -> object:
            got = read(*args, **kwargs)  # type: ignore[arg-type]
            store.tag("acme/chat@2", "prod")
            return got

        monkeypatch.setattr(store, "read", read_then_move)
        info = backend.pull("acme/chat:prod", str(tmp_path / "out"))
        assert info["version"] == 1
        assert torch.equal(logits(load_peft(tmp_path / "out", "llama")), logits(load_peft(d1, "llama")))
        monkeypatch.undo()
        store.tag("acme/chat@1", "prod")
        monkeypatch.setattr(store, "read", read_then_move)
        assert store.load("acme/chat:prod").content_id() == load_peft_dir(d1).content_id()
    finally:
        backend.close()
