"""``mint`` paths scripts rely on beyond the round trip: sweep, --min-live, --index, --base, S3
URLs, the plain-text output, and the exit codes of ``mint serve``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from mint_store.store import Store
from tests.support.cli import run
from tests.support.factories import random_adapter
from tests.support.hf_models import make_peft_dir
from tests.support.targets import make_bucket


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_dir(tmp_path_factory.mktemp("cli") / "peft", "llama", seed=0, r=2, lora_alpha=4,
                         target_modules=["q_proj", "v_proj"])


def retired_store(path: Path) -> str:
    """Four one-row shards, one row dead; compacted (without a sweep): four retired shards."""
    with Store.open(str(path)) as store:
        for i in range(4):
            store.publish("acme", f"a{i}", random_adapter(i))
        store.delete("acme/a0")
    return str(path)


def test_sweep_deletes_retired_shards_only_after_the_grace(capsys, tmp_path: Path) -> None:
    store = retired_store(tmp_path / "store")
    code, out, _ = run(capsys, "compact", "--store", store, "--json")
    report = json.loads(out)
    assert code == 0 and len(report["shards_retired"]) == 4 and "swept" not in report
    retired = report["shards_retired"]
    assert all((tmp_path / "store" / k).exists() for k in retired)  # compact alone deletes nothing
    code, out, _ = run(capsys, "sweep", "--store", store, "--json")  # default grace: 600 s
    assert code == 0 and json.loads(out) == {"deleted": []}
    code, out, _ = run(capsys, "sweep", "--store", store, "--grace", "0")
    assert code == 0 and out.split() == ["shards", "deleted", "4"]
    assert not any((tmp_path / "store" / k).exists() for k in retired)
    code, out, _ = run(capsys, "fsck", "--store", store, "--json")
    assert code == 0 and json.loads(out)["clean"]


def test_min_live_chooses_which_shards_are_rewritten(capsys, tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "store")) as store:  # one shard of four rows, three of them dead
        with store.held_commits():
            futs = [store.publish_async("acme", f"a{i}", random_adapter(i)) for i in range(4)]
        [f.result() for f in futs]
        for i in range(3):
            store.delete(f"acme/a{i}")
    store_dir = str(tmp_path / "store")
    code, out, _ = run(capsys, "compact", "--min-live", "0.2", "--store", store_dir, "--json")
    assert code == 0 and json.loads(out)["rows_moved"] == 0  # 1/4 live is not below 0.2
    code, out, _ = run(capsys, "compact", "--min-live", "0.5", "--store", store_dir, "--json")
    report = json.loads(out)
    assert code == 0 and (report["rows_moved"], report["rows_dropped"]) == (1, 3)


def test_index_option_puts_the_index_where_asked(capsys, tmp_path: Path, adapter_dir: Path) -> None:
    store, index = tmp_path / "store", tmp_path / "elsewhere" / "idx"
    code, _, err = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--store", str(store),
                       "--index", str(index))
    assert code == 0, err
    assert (index / "db" / "data.mdb").exists() and not (store / "index").exists()
    code, out, _ = run(capsys, "show", "acme/chat", "--store", str(store), "--index", str(index), "--json")
    assert code == 0 and json.loads(out)["version"] == 1
    code, out, _ = run(capsys, "stats", "--store", str(store), "--index", str(index), "--json")
    assert code == 0 and json.loads(out)["versions"] == 1
    assert not (store / "index").exists()


def test_base_is_recorded_and_checked_against_a_registered_base(capsys, tmp_path: Path, adapter_dir: Path) -> None:
    store = str(tmp_path / "store")
    with Store.open(store) as s:  # tiny llama: hidden 32, 2 kv heads of 8 (k/v project to 16)
        s.register_base("tiny-llama", {f"model.layers.{i}.self_attn.{m}": [32, 32 if m in ("q_proj", "o_proj") else 16]
                                       for i in range(2) for m in ("q_proj", "k_proj", "v_proj", "o_proj")})
        s.register_base("wider", {f"model.layers.{i}.self_attn.{m}": [48, 48]
                                  for i in range(2) for m in ("q_proj", "k_proj", "v_proj", "o_proj")})
    code, out, err = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--base", "tiny-llama",
                         "--store", store, "--json")
    assert code == 0, err
    code, out, _ = run(capsys, "show", "acme/chat", "--store", store, "--json")
    assert json.loads(out)["base"] == "tiny-llama"
    code, out, err = run(capsys, "publish", str(adapter_dir), "--name", "acme/other", "--base", "wider",
                         "--store", store)
    assert code == 1 and out == "" and err.startswith("mint: error:") and "q_proj" in err
    code, out, _ = run(capsys, "ls", "acme", "--store", store, "--json")
    assert [i["name"] for i in json.loads(out)] == ["chat"]  # the refused one left nothing


def test_an_s3_url_works_like_a_directory(capsys, tmp_path: Path, adapter_dir: Path, s3_endpoint: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_ENDPOINT_URL": s3_endpoint, "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    url = f"s3://{make_bucket(s3_endpoint)}/mint"
    index = str(tmp_path / "index")
    code, out, err = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--tag", "prod",
                         "--store", url, "--index", index, "--json")
    assert code == 0, err
    cid = json.loads(out)["content_id"]
    code, out, _ = run(capsys, "show", "acme/chat:prod", "--store", url, "--index", index, "--json")
    assert code == 0 and json.loads(out)["content_id"] == cid
    code, _, err = run(capsys, "pull", "acme/chat:prod", "-o", str(tmp_path / "out"), "--store", url, "--index", index)
    assert code == 0, err
    assert (tmp_path / "out" / "adapter_model.safetensors").stat().st_size > 0
    code, out, _ = run(capsys, "fsck", "--store", url, "--index", index, "--json")
    assert code == 0 and json.loads(out)["rows_checked"] == 1
    import s3fs

    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    assert any("/log/" in k for k in fs.find(url.removeprefix("s3://")))  # the store lives in the bucket


def test_plain_text_output(capsys, tmp_path: Path, adapter_dir: Path) -> None:
    store = str(tmp_path / "store")
    code, out, _ = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--store", store)
    m = re.fullmatch(r"published acme/chat@1 ([0-9a-f]{32})\n", out)
    assert code == 0 and m, out
    cid = m.group(1)
    code, out, _ = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--store", store)
    assert out == f"published acme/chat@2 {cid} (deduplicated)\n"
    assert run(capsys, "tag", "acme/chat@1", "prod", "--store", store)[1] == "acme/chat:prod -> 1\n"
    assert run(capsys, "ls", "--store", store)[1] == "acme\n"
    assert run(capsys, "ls", "acme", "--store", store)[1] == "acme/chat  latest=2  versions=2\n"
    text = run(capsys, "show", "acme/chat:prod", "--store", store)[1]
    shown = dict(line.split(": ", 1) for line in text.splitlines())
    assert (shown["tenant"], shown["name"], shown["version"], shown["content_id"]) == ("acme", "chat", "1", cid)
    assert run(capsys, "rm", "acme/chat@2", "--store", store)[1] == "deleted acme/chat@2\n"
    code, out, _ = run(capsys, "pull", "acme/chat@1", "-o", str(tmp_path / "o"), "--store", store)
    assert out == f"wrote {(tmp_path / 'o').resolve()}\n"
    code, out, _ = run(capsys, "fsck", "--store", store, "--no-progress")
    assert code == 0 and re.search(r"^rows checked\s+1$", out, re.M) and re.search(r"^clean\s+True$", out, re.M)
    code, out, _ = run(capsys, "stats", "--store", store)
    assert code == 0 and re.search(r"^versions\s+2$", out, re.M)


# -- mint serve: exit codes --------------------------------------------------------------------


def serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "mint_store.cli", "serve", *argv], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env or dict(os.environ))


def test_serve_exits_0_after_sigterm(tmp_path: Path) -> None:
    proc = serve("--store", str(tmp_path / "store"), "--port", "0")
    try:
        url = None
        for line in proc.stderr:  # type: ignore[union-attr]
            found = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
            if found:
                url = found.group(1)
                break
        assert url, "the server never said where it serves"
        with urllib.request.urlopen(f"{url}/healthz", timeout=30) as r:
            assert json.loads(r.read())["status"] == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("case", ["public without tokens", "port in use", "writer held", "bad token file"])
def test_serve_exit_codes(capsys, tmp_path: Path, case: str) -> None:
    store = str(tmp_path / "store")
    Store.open(store).close()
    args: list[str] = ["serve", "--store", store]
    held = None
    with socket.socket() as busy:
        if case == "public without tokens":
            args += ["--host", "0.0.0.0", "--port", "0"]
        elif case == "port in use":
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            args += ["--port", str(busy.getsockname()[1])]
        elif case == "writer held":
            held = Store.open(store)  # this process holds the writer lock
            args += ["--port", "0"]
        else:
            (tmp_path / "tokens.json").write_text("{not json")
            args += ["--port", "0", "--tokens", str(tmp_path / "tokens.json")]
        try:
            code, out, err = run(capsys, *args)
        finally:
            if held is not None:
                held.close()
    assert code == 1, err  # every error exits 1 (argparse's own usage errors exit 2)
    assert out == "" and "mint: error:" in err
