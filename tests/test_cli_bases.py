"""``mint base add NAME --config DIR`` / ``mint base ls``: registering the bases ``publish --base``
is checked against, from a transformers config.json, on a local store and through a server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mint_store.service import ServerThread, ServiceConfig
from tests.support.cli import run
from tests.support.hf_models import MODEL_KINDS, build_model, make_peft_dir, model_config

ADMIN, ACME = "admin-token-for-bases-0001", "acme-token-for-bases-00002"


def llama_config_dir(path: Path, hidden: int = 32) -> Path:
    """A config.json alone (no weights), the way a model checkout holds it."""
    import transformers as tf

    tf.LlamaConfig(vocab_size=128, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=48,
                   tie_word_embeddings=False).save_pretrained(path)
    return path


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    # hf_models' llama: hidden 32, q 32 / kv 16, MLP 48 -- the shapes llama_config_dir(hidden=32) describes
    return make_peft_dir(tmp_path / "peft", "llama", seed=0, r=4, lora_alpha=8,
                         target_modules=["q_proj", "v_proj", "down_proj"])


def test_base_add_ls_and_publish_checked_against_it(capsys, tmp_path: Path, adapter_dir: Path) -> None:
    store = str(tmp_path / "store")
    code, _, _ = run(capsys, "publish", str(adapter_dir), "--name", "acme/plain", "--store", store)
    assert code == 0
    code, out, err = run(capsys, "base", "add", "tiny-llama", "--config", str(llama_config_dir(tmp_path / "cfg")),
                         "--store", store, "--json")
    assert code == 0, err
    assert json.loads(out) == {"base": "tiny-llama", "modules": 30}  # 2 layers x 7 linears + lm_head, x2 forms
    code, _, err = run(capsys, "base", "add", "wide-llama", "--config",
                       str(llama_config_dir(tmp_path / "cfg2", hidden=64)), "--store", store)
    assert code == 0, err
    code, out, _ = run(capsys, "base", "ls", "--store", store, "--json")
    assert json.loads(out) == [{"base": "tiny-llama", "modules": 30}, {"base": "wide-llama", "modules": 30}]
    code, out, _ = run(capsys, "base", "ls", "--store", store)
    assert out.splitlines() == ["tiny-llama  modules=30", "wide-llama  modules=30"]

    code, out, err = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--base", "tiny-llama",
                         "--store", store, "--json")
    assert code == 0, err
    fits = json.loads(out)
    code, out, err = run(capsys, "publish", str(adapter_dir), "--name", "acme/wrong", "--base", "wide-llama",
                         "--store", store, "--json")
    assert (code, out) == (1, "")
    assert err.startswith("mint: error: module 'model.layers.0.") and "base 'wide-llama' has" in err
    code, out, _ = run(capsys, "ls", "acme", "--store", store, "--json")
    assert [i["name"] for i in json.loads(out)] == ["chat", "plain"]  # the mismatch stored nothing
    # the base is part of the content id: the same files without --base are another content id
    code, out, _ = run(capsys, "show", "acme/plain", "--store", store, "--json")
    plain = json.loads(out)
    assert plain["base"] == "unspecified" and plain["content_id"] != fits["content_id"]


def test_base_add_refuses_a_bad_config_and_changes_nothing(capsys, tmp_path: Path) -> None:
    store = tmp_path / "store"
    code, out, err = run(capsys, "base", "add", "x", "--config", str(tmp_path / "nope"), "--store", str(store))
    assert (code, out) == (1, "") and "does not exist" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "base", "add", "x", "--config", str(tmp_path / "empty"), "--store", str(store))
    assert code == 1 and "has no config.json" in err
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no-such-model"}')
    code, _, err = run(capsys, "base", "add", "x", "--config", str(tmp_path / "odd"), "--store", str(store))
    assert code == 1 and "no-such-model" in err
    code, _, err = run(capsys, "base", "add", "Bad/Name", "--config", str(tmp_path / "odd"), "--store", str(store))
    assert code == 1 and "invalid" in err
    assert not store.exists()  # refused before anything was opened or created


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_config_shapes_are_the_engine_targets(tmp_path: Path, kind: str) -> None:
    """What a registered base accepts is exactly what the engine can apply to that model."""
    from engine_client.engine.targets import model_targets
    from mint_store.peft.bases import shapes_from_config

    model_config(kind).save_pretrained(tmp_path)
    targets = model_targets(build_model(kind))
    want = {n: [t.in_features, t.out_features] + ([t.experts] if t.experts is not None else [])
            for n, t in targets.items()}
    assert shapes_from_config(tmp_path) == want


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [{"token": ADMIN, "tenants": [], "role": "admin"},
                                             {"token": ACME, "tenants": ["acme"], "role": "write"}]}))
    srv = ServerThread(ServiceConfig(store=str(tmp_path / "served"), port=0, tokens_file=str(tokens),
                                     auto_compact=False))
    yield srv
    srv.stop()


def test_base_add_and_ls_through_the_server(capsys, tmp_path: Path, server: ServerThread, adapter_dir: Path) -> None:
    cfg = str(llama_config_dir(tmp_path / "cfg"))
    wide = str(llama_config_dir(tmp_path / "cfg2", hidden=64))
    code, _, err = run(capsys, "base", "add", "tiny-llama", "--config", cfg, "--server", server.url, "--token", ACME)
    assert code == 1 and "admin" in err  # bases are shared by every tenant: an admin registers them
    for name, d in (("tiny-llama", cfg), ("wide-llama", wide)):
        code, out, err = run(capsys, "base", "add", name, "--config", d, "--server", server.url, "--token", ADMIN,
                             "--json")
        assert code == 0 and json.loads(out) == {"base": name, "modules": 30}, err
    code, out, _ = run(capsys, "base", "ls", "--server", server.url, "--token", ACME, "--json")
    assert json.loads(out) == [{"base": "tiny-llama", "modules": 30}, {"base": "wide-llama", "modules": 30}]
    code, out, err = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--base", "tiny-llama",
                         "--server", server.url, "--token", ACME, "--json")
    assert code == 0 and json.loads(out)["version"] == 1, err
    code, out, err = run(capsys, "publish", str(adapter_dir), "--name", "acme/chat", "--base", "wide-llama",
                         "--server", server.url, "--token", ACME, "--json")
    assert (code, out) == (1, "") and "base 'wide-llama' has" in err


def test_listing_routes_need_a_token(server: ServerThread) -> None:
    import urllib.error
    import urllib.request

    for path in ("/v1/bases", "/v1/tenants"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + path, timeout=30)
        assert e.value.code == 401 and json.loads(e.value.read())["error"] == "unauthorized"
        req = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {ACME}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
