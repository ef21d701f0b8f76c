"""The Hugging Face Hub read protocol under /hf, with the real huggingface_hub and PEFT clients.

The server runs in its own thread (ServerThread): the Hub client is synchronous.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_download, hf_hub_url, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from engine_client import SyncMintClient
from mint_store.cli.commands import main as mint_main
from mint_store.peft.directory import load_peft_dir
from mint_store.service import ServerThread, ServiceConfig
from mint_store.service.hub.repo import commit_id, parse_revision
from tests.support.hf_models import build_model, load_peft, logits
from tests.support.service import PEFT_NAMES, TOKENS

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
RESOLVE = "/hf/{tenant}/{name}/resolve/{revision}/{filename}"
W, C, R = "adapter_model.safetensors", "adapter_config.json", "README.md"


@dataclass
class Hub:
    server: ServerThread
    root: Path
    dirs: dict[str, Path]  # v1 / v2: the original PEFT directories

    @property
    def endpoint(self) -> str:
        return self.server.url + "/hf"

    def client(self, who: str = "acme") -> SyncMintClient:
        return SyncMintClient(self.server.url, token=TOKENS[who])


def _tokens(path: Path) -> str:
    path.write_text(json.dumps({"tokens": [
        {"token": TOKENS["acme"], "tenants": ["acme"], "role": "write"},
        {"token": TOKENS["beta"], "tenants": ["beta"], "role": "write"},
        {"token": TOKENS["acme-read"], "tenants": ["acme"], "role": "read"},
        {"token": TOKENS["admin"], "role": "admin"},
    ]}))
    return str(path)


def _serve(root: Path) -> ServerThread:
    (root / "uploads").mkdir(parents=True, exist_ok=True)
    return ServerThread(ServiceConfig(store=str(root / "store"), host="127.0.0.1", port=0, workers=2,
                                      auto_compact=False, upload_dir=str(root / "uploads"),
                                      tokens_file=_tokens(root / "tokens.json")))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, peft_dir: Path, peft_dir2: Path) -> Iterator[Hub]:
    """acme/chat: @1 = v1 (tag prod), @2 = v2 (main). acme/moving: the same, for tag moves.
    acme/gone: @1, @2 deleted. beta/other: v1."""
    root = tmp_path_factory.mktemp("hub")
    h = Hub(_serve(root), root, {"v1": peft_dir, "v2": peft_dir2})
    try:
        with h.client() as c:
            for name in ("chat", "moving", "gone"):
                c.publish("acme", name, load_peft_dir(peft_dir), tag="prod")
                c.publish("acme", name, load_peft_dir(peft_dir2))
            c.delete("acme/gone@2")
        with h.client("beta") as c:
            c.publish("beta", "other", load_peft_dir(peft_dir))
        yield h
    finally:
        h.server.stop()


def _pulled(hub: Hub, ref: str, out: Path) -> dict[str, bytes]:
    """What `mint pull REF` writes (through the service)."""
    assert mint_main(["pull", ref, "-o", str(out), "--server", hub.server.url, "--token", TOKENS["acme"]]) == 0
    return {n: (out / n).read_bytes() for n in PEFT_NAMES}


def _resolve_count(hub: Hub) -> dict[str, float]:
    """Requests the server answered on the Hub file route, by method (its Prometheus counter)."""
    req = urllib.request.Request(hub.server.url + "/metrics", headers={"Authorization": f"Bearer {TOKENS['admin']}"})
    with urllib.request.urlopen(req) as r:  # /metrics sums every tenant: admin only with a token file
        text = r.read().decode()
    out: dict[str, float] = {"GET": 0.0, "HEAD": 0.0}
    for line in text.splitlines():
        if line.startswith("mint_http_requests_total{") and f'route="{RESOLVE}"' in line:
            method = line.split('method="', 1)[1].split('"', 1)[0]
            out[method] = out.get(method, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _raw(hub: Hub, method: str, path: str, headers: dict[str, str] | None = None,
         who: str = "acme") -> tuple[int, dict[str, str], bytes]:
    """One request, redirects not followed."""
    host, port = hub.server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {TOKENS[who]}", **(headers or {})})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def _sha(hub: Hub, repo: str, revision: str | None = None) -> str:
    sha = HfApi(endpoint=hub.endpoint, token=TOKENS["acme"]).model_info(repo, revision=revision).sha
    assert sha is not None
    return sha


def test_snapshot_download_is_what_mint_pull_writes_and_a_second_call_downloads_nothing(
        hub: Hub, tmp_path: Path) -> None:
    cache = tmp_path / "hf-cache"
    before = _resolve_count(hub)
    path = Path(snapshot_download(repo_id="acme/chat", revision="prod", endpoint=hub.endpoint,
                                  cache_dir=str(cache), token=TOKENS["acme"]))
    after_first = _resolve_count(hub)
    assert after_first["GET"] - before["GET"] == 3  # the three files, downloaded once each
    assert sorted(p.name for p in path.iterdir()) == sorted([C, W, R])
    # byte-identical to `mint pull`, and the commit is version 1's
    assert {n: (path / n).read_bytes() for n in PEFT_NAMES} == _pulled(hub, "acme/chat:prod", tmp_path / "pull")
    assert path.name == _sha(hub, "acme/chat", "v1") != _sha(hub, "acme/chat")
    card = (path / R).read_text()
    with hub.client() as c:
        info = c.version("acme/chat@1")
    for fact in (f"| version | {info.version} |", f"`{info.content_id}`", "| rank | 4 |", "q_proj", "| tags | prod |"):
        assert fact in card
    # PEFT loads the snapshot; logits equal the published adapter's original directory
    got = logits(load_peft(path))
    assert torch.equal(got, logits(load_peft(hub.dirs["v1"])))
    assert not torch.equal(got, logits(build_model()))  # not vacuous: the adapter changes the output

    again = Path(snapshot_download(repo_id="acme/chat", revision="prod", endpoint=hub.endpoint,
                                   cache_dir=str(cache), token=TOKENS["acme"]))
    assert again == path
    assert _resolve_count(hub) == after_first  # no GET and no HEAD of any file: all from the cache


_PEFT_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from tests.support.hf_models import build_model, logits
from peft import PeftModel
from safetensors.torch import save_file
from engine_client import SyncMintClient

def load():
    return logits(PeftModel.from_pretrained(build_model(), "acme/moving", revision="prod").eval())

out = {"before": load()}
with SyncMintClient(sys.argv[2], token=sys.argv[3]) as c:
    c.tag("acme/moving@2", "prod")
out["after"] = load()
save_file(out, sys.argv[4])
"""


def test_peft_from_pretrained_through_hf_endpoint_follows_a_moved_tag(hub: Hub, tmp_path: Path) -> None:
    """A fresh process with only HF_ENDPOINT/HF_TOKEN set: huggingface_hub reads them at import."""
    from safetensors.torch import load_file

    out = tmp_path / "logits.safetensors"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update({"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKENS["acme"], "HF_HOME": str(tmp_path / "hf"),
                "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"})
    proc = subprocess.run([sys.executable, "-c", _PEFT_SCRIPT, str(ROOT), hub.server.url, TOKENS["acme"], str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = load_file(str(out))
    assert torch.equal(got["before"], logits(load_peft(hub.dirs["v1"])))
    assert torch.equal(got["after"], logits(load_peft(hub.dirs["v2"])))  # the moved tag, on the next call


def test_hf_hub_download_every_file_at_every_revision_form(hub: Hub, tmp_path: Path) -> None:
    v1, v2 = _sha(hub, "acme/chat", "1"), _sha(hub, "acme/chat", "main")
    expected = {1: _pulled(hub, "acme/chat@1", tmp_path / "p1"), 2: _pulled(hub, "acme/chat@2", tmp_path / "p2")}
    forms = {"prod": 1, "v1": 1, "1": 1, v1: 1, "main": 2, "2": 2, v2: 2}
    for revision, version in forms.items():
        for name in PEFT_NAMES:
            got = hf_hub_download("acme/chat", name, revision=revision, endpoint=hub.endpoint,
                                  cache_dir=str(tmp_path / "c"), token=TOKENS["acme-read"])
            assert Path(got).read_bytes() == expected[version][name], (revision, name)
        card = hf_hub_download("acme/chat", R, revision=revision, endpoint=hub.endpoint,
                               cache_dir=str(tmp_path / "c"), token=TOKENS["acme"])
        assert f"| version | {version} |" in Path(card).read_text()
    info = HfApi(endpoint=hub.endpoint, token=TOKENS["acme"]).model_info("acme/chat", revision="prod",
                                                                        files_metadata=True)
    sizes = {s.rfilename: (s.size, s.lfs.sha256 if s.lfs else None) for s in info.siblings or []}
    weights = expected[1][W]
    assert sizes[W] == (len(weights), hashlib.sha256(weights).hexdigest())
    assert sizes[C] == (len(expected[1][C]), None)
    tree = {f.path: f for f in HfApi(endpoint=hub.endpoint, token=TOKENS["acme"]).list_repo_tree(
        "acme/chat", revision="v2", recursive=True)}
    assert set(tree) == {C, W, R}
    assert tree[W].size == len(expected[2][W]) and tree[W].lfs is not None


def test_head_metadata_redirect_range_and_etags(hub: Hub) -> None:
    commit = _sha(hub, "acme/chat", "prod")
    meta = get_hf_file_metadata(hf_hub_url("acme/chat", W, revision="prod", endpoint=hub.endpoint),
                                token=TOKENS["acme"])
    status, headers, weights = _raw(hub, "GET", f"/hf/acme/chat/resolve/{commit}/{W}")
    assert status == 200
    assert meta.commit_hash == commit and meta.size == len(weights)
    assert meta.etag == hashlib.sha256(weights).hexdigest()
    assert meta.location.endswith(f"/hf/acme/chat/resolve/{commit}/{W}")  # pinned to the commit
    assert headers["ETag"] == f'"{meta.etag}"' and headers["X-Repo-Commit"] == commit

    # the weights at a moving revision: a 302 to the commit, with the LFS headers
    status, headers, _ = _raw(hub, "HEAD", f"/hf/acme/chat/resolve/prod/{W}")
    assert status == 302 and headers["Location"] == f"../{commit}/{W}"
    assert headers["X-Linked-Etag"] == f'"{meta.etag}"' and headers["X-Linked-Size"] == str(len(weights))
    assert headers["X-Repo-Commit"] == commit

    # a small file at a moving revision: pinned to the commit too
    status, headers, _ = _raw(hub, "HEAD", f"/hf/acme/chat/resolve/prod/{C}")
    assert status == 302 and headers["Location"] == f"../{commit}/{C}" and headers["X-Repo-Commit"] == commit
    # HEAD of a small file: 200, its git blob id, its length
    status, headers, body = _raw(hub, "HEAD", f"/hf/acme/chat/resolve/{commit}/{C}")
    config = _raw(hub, "GET", f"/hf/acme/chat/resolve/{commit}/{C}")[2]
    blob = hashlib.sha1(b"blob %d\0" % len(config) + config).hexdigest()
    assert status == 200 and body == b"" and headers["Content-Length"] == str(len(config))
    assert headers["ETag"] == f'"{blob}"' and headers["X-Repo-Commit"] == commit

    # Range: 206 with Content-Range; a suffix range; If-None-Match: 304
    status, headers, part = _raw(hub, "GET", f"/hf/acme/chat/resolve/{commit}/{W}", {"Range": "bytes=10-99"})
    assert status == 206 and part == weights[10:100]
    assert headers["Content-Range"] == f"bytes 10-99/{len(weights)}"
    status, _, part = _raw(hub, "GET", f"/hf/acme/chat/resolve/{commit}/{C}", {"Range": "bytes=-7"})
    assert status == 206 and part == config[-7:]
    status, headers, _ = _raw(hub, "GET", f"/hf/acme/chat/resolve/{commit}/{W}", {"Range": f"bytes={len(weights)}-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(weights)}"
    status, _, body = _raw(hub, "GET", f"/hf/acme/chat/resolve/{commit}/{W}", {"If-None-Match": f'"{meta.etag}"'})
    assert status == 304 and body == b""


def _download(hub: Hub, tmp_path: Path, repo: str = "acme/chat", name: str = C, token: Any = TOKENS["acme"],
              **kw: Any) -> str:
    return hf_hub_download(repo, name, endpoint=hub.endpoint, cache_dir=str(tmp_path / "c"), token=token, **kw)


def test_a_tag_moved_between_the_clients_head_and_get_leaves_the_heads_commit_in_its_cache(
        hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub asks HEAD for the commit and ETag, then GETs the file: a tag moved in
    between must not put the next commit's bytes in its cache under the first one's commit."""
    import huggingface_hub.file_download as fd

    with hub.client() as c:
        c.publish("acme", "race", load_peft_dir(hub.dirs["v1"]), tag="prod")
        c.publish("acme", "race", load_peft_dir(hub.dirs["v2"]))
        first = _sha(hub, "acme/race", "prod")
        expected = {v: _pulled(hub, f"acme/race@{v}", tmp_path / f"p{v}")[C] for v in (1, 2)}
        assert expected[1] != expected[2]
        real = fd.get_hf_file_metadata

        def head_then_move(*args: Any, **kwargs: Any) -> Any:
            meta = real(*args, **kwargs)
            c.tag("acme/race@2", "prod")  # the tag moves between the HEAD and the GET
            return meta

        monkeypatch.setattr(fd, "get_hf_file_metadata", head_then_move)
        path = Path(_download(hub, tmp_path, "acme/race", C, revision="prod"))
    assert path.parent.name == first and path.read_bytes() == expected[1]


def test_unknown_repo_file_and_revision_raise_the_client_errors(hub: Hub, tmp_path: Path) -> None:
    api = HfApi(endpoint=hub.endpoint, token=TOKENS["acme"])
    for repo in ("acme/nope", "nobody/chat", "Acme/Chat"):
        with pytest.raises(RepositoryNotFoundError):
            _download(hub, tmp_path, repo)
        with pytest.raises(RepositoryNotFoundError):
            api.model_info(repo)
    with pytest.raises(RepositoryNotFoundError):
        _download(hub, tmp_path, "acme/nope", revision="prod")  # a missing repo, not a missing tag
    with pytest.raises(EntryNotFoundError):
        _download(hub, tmp_path, name="pytorch_model.bin")
    for revision in ("nope", "99", "v99", "f" * 40, "refs/pr/1", "v0"):
        with pytest.raises(RevisionNotFoundError):
            _download(hub, tmp_path, revision=revision)
        with pytest.raises(RevisionNotFoundError):
            api.model_info("acme/chat", revision=revision)
    # a deleted version: by number and by its commit id; main is the latest live version
    with hub.client() as c:
        gone = c.version("acme/gone@2")
    for revision in ("2", commit_id("acme", "gone", 2, gone.content_id, gone.peft_config)):
        with pytest.raises(RevisionNotFoundError):
            _download(hub, tmp_path, "acme/gone", revision=revision)
    assert _sha(hub, "acme/gone") == _sha(hub, "acme/gone", "1")
    # a version's commit id is that version only in its own repo
    with pytest.raises(RevisionNotFoundError):
        api.model_info("acme/moving", revision=_sha(hub, "acme/chat", "1"))
    # every version deleted: no repo, as repo_exists() and model_info() understand it
    with hub.client() as c:
        c.publish("acme", "emptied", load_peft_dir(hub.dirs["v1"]))
        c.delete("acme/emptied@1")
    assert api.repo_exists("acme/emptied") is False and api.repo_exists("acme/chat") is True
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("acme/emptied")


def test_tenant_rules_apply_to_hub_tokens(hub: Hub, tmp_path: Path) -> None:
    # beta's token: acme does not exist for it, whatever it asks for
    for repo, name in (("acme/chat", C), ("acme/chat", W), ("acme/nope", C)):
        with pytest.raises(RepositoryNotFoundError):
            _download(hub, tmp_path, repo, name, token=TOKENS["beta"], revision="prod")
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.endpoint, token=TOKENS["beta"]).model_info("acme/chat")
    assert Path(_download(hub, tmp_path / "b", "beta/other", token=TOKENS["beta"])).is_file()
    # no token: 401 that the client reads as a repo to authenticate for
    with pytest.raises(RepositoryNotFoundError) as e:
        HfApi(endpoint=hub.endpoint, token=False).model_info("acme/chat")
    assert e.value.response.status_code == 401
    # an unknown token: 401, "invalid credentials", not a missing repo
    with pytest.raises(HfHubHTTPError) as e2:
        HfApi(endpoint=hub.endpoint, token="not-a-mint-token-at-all").model_info("acme/chat")
    assert e2.value.response.status_code == 401 and not isinstance(e2.value, RepositoryNotFoundError)
    status, headers, _ = _raw(hub, "GET", "/hf/acme/chat/resolve/main/README.md", who="beta")
    assert status == 404 and headers["X-Error-Code"] == "RepoNotFound"


def test_commit_ids_are_stable_across_restarts(tmp_path: Path, peft_dir: Path) -> None:
    server = _serve(tmp_path)
    try:
        with SyncMintClient(server.url, token=TOKENS["acme"]) as c:
            info = c.version(f"acme/x@{c.publish('acme', 'x', load_peft_dir(peft_dir)).version}")
        before = HfApi(endpoint=server.url + "/hf", token=TOKENS["acme"]).model_info("acme/x").sha
    finally:
        server.stop()
    server = _serve(tmp_path)
    try:
        api = HfApi(endpoint=server.url + "/hf", token=TOKENS["acme"])
        assert api.model_info("acme/x").sha == before == commit_id("acme", "x", 1, info.content_id, info.peft_config)
        assert api.model_info("acme/x", revision=before).sha == before  # a fresh server finds it by its id
    finally:
        server.stop()


def test_revision_grammar() -> None:
    assert parse_revision("main").kind == "latest"
    assert parse_revision("v7").version == 7 and parse_revision("7").version == 7
    assert parse_revision("a" * 40).kind == "commit" and parse_revision("a" * 40).tag == "a" * 40
    assert parse_revision("prod").tag == "prod"
    assert len(commit_id("acme", "chat", 1, "0" * 32)) == 40
    assert commit_id("acme", "chat", 1, "0" * 32) != commit_id("acme", "chat", 2, "0" * 32)
    # the same tensors with another config are other files: another commit
    assert commit_id("acme", "chat", 1, "0" * 32, {"target_modules": ["q_proj", "v_proj"]}) != commit_id(
        "acme", "chat", 1, "0" * 32, {"target_modules": ["v_proj", "q_proj"]})


def test_mint_pull_and_publish_from_an_hf_source(hub: Hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKENS["acme"])  # the source's token: read acme
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # read at import: patched
    reference = _pulled(hub, "acme/chat:prod", tmp_path / "ref")
    capsys.readouterr()
    out = tmp_path / "out"
    assert mint_main(["pull", "hf://acme/chat@prod", "-o", str(out), "--hf-endpoint", hub.endpoint, "--json"]) == 0
    pulled = json.loads(capsys.readouterr().out)
    assert {n: (out / n).read_bytes() for n in PEFT_NAMES} == reference
    assert pulled["commit"] == _sha(hub, "acme/chat", "prod")
    # publish into beta (its own token) what acme serves as a Hub repo
    assert mint_main(["publish", "hf://acme/chat@v2", "--name", "beta/copy", "--hf-endpoint", hub.endpoint,
                      "--server", hub.server.url, "--token", TOKENS["beta"], "--json"]) == 0
    published = json.loads(capsys.readouterr().out)
    with hub.client() as c:
        assert published["content_id"] == c.version("acme/chat@2").content_id
    # errors: a typed message, exit 1, nothing written
    assert mint_main(["pull", "hf://acme/nope", "-o", str(tmp_path / "none"), "--hf-endpoint", hub.endpoint]) == 1
    assert "no repo" in capsys.readouterr().err and not (tmp_path / "none").exists()
    assert mint_main(["pull", "hf://acme/chat@nope", "-o", str(tmp_path / "none"),
                      "--hf-endpoint", hub.endpoint]) == 1
    assert "no such revision" in capsys.readouterr().err and not (tmp_path / "none").exists()
