"""MintResolver (the logic behind the vLLM plugin) against a real store and a real loopback service."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine_client import SyncMintClient
from engine_client.vllm_plugin import AdapterUnavailable, MintResolver, PluginConfig, Resolution, WrongBase
from engine_client.vllm_plugin.bases import served_base
from engine_client.vllm_plugin.ids import MAX_LORA_ID, IdTable, derived_id
from mint_store.errors import AdapterNotFound, InvalidName, TagNotFound, VersionDeleted, VersionNotFound
from mint_store.peft.directory import load_peft_dir
from mint_store.service import ServerThread, ServiceConfig
from mint_store.store import Store
from tests.support.vllm_plugin import BASE, MODEL, ResolverFactory

Source = tuple[str, SyncMintClient | Store]


@pytest.fixture(params=["service", "store"])
def source(request: pytest.FixtureRequest) -> Iterator[Source]:
    """(URL the resolver is given, something to publish with): a loopback service or a local store."""
    if request.param == "service":
        server: ServerThread = request.getfixturevalue("server")
        yield server.url, request.getfixturevalue("publisher")
    else:
        store: Store = request.getfixturevalue("store")
        yield str(store.storage.root), store


def publish(pub: SyncMintClient | Store, tenant: str, name: str, path: Path, *, base: str = BASE,
            tag: str | None = None) -> str:
    adapter = load_peft_dir(path, base=base)
    got = pub.publish(tenant, name, adapter, tag=tag)
    return got.content_id


def check(res: Resolution | None, content_id: str, cache_dir: Path) -> Resolution:
    assert res is not None
    assert res.content_id == content_id
    assert Path(res.path) == cache_dir / "entries" / content_id
    assert load_peft_dir(res.path, base=res.base).content_id() == content_id  # the files are that content
    assert 1 <= res.lora_int_id <= MAX_LORA_ID
    return res


def test_every_ref_form_resolves_to_its_content(source: Source, peft_dirs: list[Path],
                                                make_resolver: ResolverFactory, tmp_path: Path) -> None:
    url, pub = source
    c1 = publish(pub, "acme", "support", peft_dirs[0], tag="prod")
    c2 = publish(pub, "acme", "support", peft_dirs[1])
    c3 = publish(pub, "acme", "other", peft_dirs[2])
    r = make_resolver(url)
    cache = tmp_path / "cache"

    latest = check(r.resolve(MODEL, "acme/support"), c2, cache)
    assert (latest.ref, latest.lora_name, latest.base, latest.created) == ("acme/support@2", "acme/support", BASE, True)
    assert check(r.resolve(MODEL, "acme/support@1"), c1, cache).ref == "acme/support@1"
    assert check(r.resolve(MODEL, "acme/support:prod"), c1, cache).created is False  # same content: cached
    assert check(r.resolve(MODEL, f"sha:{c3}"), c3, cache).ref == f"sha:{c3}"
    cfg = json.loads((Path(latest.path) / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4


def test_identical_content_is_materialised_once_with_a_stable_id(
    source: Source, peft_dirs: list[Path], make_resolver: ResolverFactory, tmp_path: Path,
) -> None:
    url, pub = source
    c = publish(pub, "acme", "one", peft_dirs[0])
    assert publish(pub, "beta", "two", peft_dirs[0]) == c
    other = publish(pub, "acme", "three", peft_dirs[1])
    r = make_resolver(url)
    a, b = r.resolve(MODEL, "acme/one"), r.resolve(MODEL, "beta/two")
    assert a is not None and b is not None
    assert (a.path, a.lora_int_id, a.created, b.created) == (b.path, b.lora_int_id, True, False)
    assert os.listdir(tmp_path / "cache" / "entries") == [c]
    third = r.resolve(MODEL, "acme/three")
    assert third is not None and third.lora_int_id != a.lora_int_id and third.content_id == other
    # another process (a fresh resolver) gives the same ids
    again = make_resolver(url).resolve(MODEL, "beta/two")
    assert again is not None and again.lora_int_id == a.lora_int_id == derived_id(c)


def test_a_moved_tag_yields_the_new_content(source: Source, peft_dirs: list[Path],
                                            make_resolver: ResolverFactory, tmp_path: Path) -> None:
    url, pub = source
    c1 = publish(pub, "acme", "support", peft_dirs[0], tag="prod")
    c2 = publish(pub, "acme", "support", peft_dirs[1])
    r = make_resolver(url)
    before = check(r.resolve(MODEL, "acme/support:prod"), c1, tmp_path / "cache")
    pub.tag("acme/support@2", "prod")
    after = check(r.resolve(MODEL, "acme/support:prod"), c2, tmp_path / "cache")
    assert after.ref == "acme/support@2" and after.lora_int_id != before.lora_int_id
    assert Path(before.path).is_dir()  # still held: the running vLLM may reload it


@pytest.mark.parametrize(("model", "override", "ok"), [
    ("/models/tiny-llama", None, True),
    ("/models/tiny-llama/", None, True),
    ("Acme/Tiny-Llama", None, True),  # the id's last part, lowercased
    ("tiny-llama", None, True),
    ("/models/tiny-llama-instruct", None, False),
    ("/models/other", None, False),
    ("/models/Tiny Llama+", None, False),  # no valid MinT name: nothing matches
    ("/anything/else", "tiny-llama", True),  # MINT_VLLM_BASE decides
    ("/models/tiny-llama", "other", False),
])
def test_the_base_must_match_the_served_model(store: Store, peft_dirs: list[Path], make_resolver: ResolverFactory,
                                              tmp_path: Path, model: str, override: str | None, ok: bool) -> None:
    c = publish(store, "acme", "support", peft_dirs[0])
    r = make_resolver(str(store.storage.root), base=override)
    if ok:
        check(r.resolve(model, "acme/support"), c, tmp_path / "cache")
        return
    with pytest.raises(WrongBase, match="acme/support") as e:
        r.resolve(model, "acme/support")
    assert "tiny-llama" in str(e.value)
    assert os.listdir(tmp_path / "cache" / "entries") == []  # nothing read, nothing written


def test_an_adapter_without_a_base_is_never_served(store: Store, peft_dirs: list[Path],
                                                   make_resolver: ResolverFactory) -> None:
    store.publish("acme", "nobase", load_peft_dir(peft_dirs[0]))  # base "unspecified"
    r = make_resolver(str(store.storage.root))
    with pytest.raises(WrongBase, match="without a base"):
        r.resolve("/models/unspecified", "acme/nobase")
    assert served_base("/models/unspecified") == "unspecified"


@pytest.mark.parametrize("direct", [False, True], ids=["files", "rows"])
def test_unknown_refs_are_not_ours(source: Source, peft_dirs: list[Path], make_resolver: ResolverFactory,
                                   direct: bool) -> None:
    url, pub = source
    publish(pub, "acme", "support", peft_dirs[0], tag="prod")
    publish(pub, "acme", "support", peft_dirs[1])
    pub.delete("acme/support@1")  # (its tag goes with it)
    r = make_resolver(url, direct=direct)
    for name in ("tiny-llama", "not a ref", "Acme/Support", "acme/nope", "nobody/support", "acme/support@9",
                 "acme/support:nope", "acme/support@1", "acme/support:prod", "sha:" + "0" * 32):
        assert r.resolve(MODEL, name) is None, name
    for name, error in (("not a ref", InvalidName), ("acme/nope", AdapterNotFound),
                        ("acme/support@9", VersionNotFound), ("acme/support:nope", TagNotFound),
                        ("acme/support@1", VersionDeleted)):
        with pytest.raises(error):
            r.lookup(MODEL, name)
    assert r.resolve(MODEL, "acme/support") is not None


@pytest.mark.parametrize("direct", [False, True], ids=["files", "rows"])
def test_an_unreachable_store_is_a_clear_error(server: ServerThread, publisher: SyncMintClient,
                                               peft_dirs: list[Path], make_resolver: ResolverFactory,
                                               tmp_path: Path, direct: bool) -> None:
    with socket.socket() as s:  # bound, never listening: connections are refused while we hold it
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(AdapterUnavailable, match=dead):
            make_resolver(dead, cache_dir=tmp_path / "c1", direct=direct).resolve(MODEL, "acme/support")
    with pytest.raises(AdapterUnavailable, match="no-such-store"):
        make_resolver(str(tmp_path / "no-such-store"), cache_dir=tmp_path / "c2", direct=direct).resolve(
            MODEL, "acme/support")

    publish(publisher, "acme", "support", peft_dirs[0])
    r = make_resolver(server.url, direct=direct)
    assert r.resolve(MODEL, "acme/support") is not None
    server.stop()  # the service goes away: an error, not a stale or wrong adapter
    with pytest.raises(AdapterUnavailable, match="acme/support"):
        r.resolve(MODEL, "acme/support")


@pytest.mark.parametrize("direct", [False, True], ids=["files", "rows"])
def test_tokens_and_tenants(tmp_path: Path, peft_dirs: list[Path], make_resolver: ResolverFactory,
                            direct: bool) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [
        {"token": "acme-token-000000000001", "tenants": ["acme"], "role": "write"},
        {"token": "beta-token-000000000002", "tenants": ["beta"], "role": "read"},
    ]}))
    (tmp_path / "up").mkdir()
    server = ServerThread(ServiceConfig(store=str(tmp_path / "s"), host="127.0.0.1", port=0, workers=2,
                                          tokens_file=str(tokens), upload_dir=str(tmp_path / "up")))
    try:
        with SyncMintClient(server.url, token="acme-token-000000000001") as pub:
            c = publish(pub, "acme", "support", peft_dirs[0])
        got = make_resolver(server.url, token="acme-token-000000000001", direct=direct).resolve(MODEL, "acme/support")
        assert got is not None and got.content_id == c
        # a token that does not hold the tenant does not see the adapter
        beta = make_resolver(server.url, token="beta-token-000000000002", direct=direct)
        assert beta.resolve(MODEL, "acme/support") is None
        with pytest.raises(AdapterUnavailable, match=r"Unauthorized|unknown token"):  # the operator's problem: say so
            make_resolver(server.url, token="wrong-token-00000000000", direct=direct).resolve(MODEL, "acme/support")
    finally:
        server.stop()


def test_eviction_through_the_resolver_rematerialises_the_same_content(
    store: Store, peft_dirs: list[Path], make_resolver: ResolverFactory, tmp_path: Path,
) -> None:
    cids = [publish(store, "acme", f"a{i}", d) for i, d in enumerate(peft_dirs[:2])]
    r = make_resolver(str(store.storage.root), cache_bytes=1, hold=False)  # room for the current one only
    first = r.resolve(MODEL, "acme/a0")
    assert first is not None and first.created
    assert r.resolve(MODEL, "acme/a1") is not None
    assert os.listdir(tmp_path / "cache" / "entries") == [cids[1]]
    again = check(r.resolve(MODEL, "acme/a0"), cids[0], tmp_path / "cache")
    assert again.created and again.lora_int_id == first.lora_int_id


def test_the_materialised_directory_runs_like_the_original(store: Store, peft_dirs: list[Path],
                                                           make_resolver: ResolverFactory) -> None:
    from tests.support.hf_models import load_peft, logits

    publish(store, "acme", "support", peft_dirs[0])
    got = make_resolver(str(store.storage.root)).resolve(MODEL, "acme/support")
    assert got is not None
    torch.testing.assert_close(logits(load_peft(got.path)), logits(load_peft(peft_dirs[0])), rtol=0, atol=0)


def test_an_adapter_whose_modules_scale_differently_is_folded_for_vllm(store: Store, tmp_path: Path,
                                                                        make_resolver: ResolverFactory) -> None:
    """vLLM applies one scaling per adapter (lora_alpha / r) and ignores rank_pattern and
    alpha_pattern: a mixed-rank or mixed-alpha adapter ran with one module's scaling everywhere.
    The files handed to vLLM fold each module's scaling into its B, under a config whose every
    scaling is 1, r the largest rank; PEFT still loads them to the same model."""
    from tests.support.hf_models import build_model, load_peft, logits, peft_model

    src = tmp_path / "mixed"
    peft_model(build_model("llama", seed=0), seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
               rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 2}).save_pretrained(str(src))
    original = load_peft_dir(src, base=BASE)
    assert len({m.scaling for m in original.modules}) == 2  # q: 2/4, v: 8/2
    publish(store, "acme", "mixed", src)
    got = make_resolver(str(store.storage.root)).resolve(MODEL, "acme/mixed")
    assert got is not None
    config = json.loads((Path(got.path) / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (4, 4, False)  # vLLM's scaling: 1
    folded = {m.name: m for m in load_peft_dir(got.path, base=BASE).modules}
    for m in original.modules:
        f = folded[m.name]
        assert f.scaling == 1.0 and torch.equal(f.a, m.a)
        torch.testing.assert_close(f.b, m.b * m.scaling, rtol=0, atol=0)
    torch.testing.assert_close(logits(load_peft(got.path)), logits(load_peft(src)), rtol=1e-5, atol=1e-5)


def test_equal_scalings_vllm_would_read_otherwise_are_folded_and_old_entries_made_again(
        store: Store, tmp_path: Path, make_resolver: ResolverFactory) -> None:
    """Equal scalings are not enough: with alpha_pattern covering every module, each module scales
    alpha_pattern / r, while vLLM reads lora_alpha / r. And an entry cached by a plugin that did not
    fold (format 1) is made again, not served by its digests."""
    import xxhash

    from engine_client.vllm_plugin.cache import DIGESTS
    from mint_store.peft.directory import peft_files
    from tests.support.hf_models import build_model, peft_model

    src = tmp_path / "patterned"
    peft_model(build_model("llama", seed=0), seed=6, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"],
               alpha_pattern={"q_proj": 8, "v_proj": 8}).save_pretrained(str(src))
    original = load_peft_dir(src, base=BASE)
    assert {m.scaling for m in original.modules} == {2.0}  # equal, yet not what lora_alpha / r says
    cid = publish(store, "acme", "patterned", src)
    # an entry left by a plugin that did not fold: the unfolded files, digests without a format
    entry = tmp_path / "cache" / "entries" / cid
    entry.mkdir(parents=True)
    config, weights = peft_files(original)
    (entry / "adapter_config.json").write_bytes(config)
    (entry / "adapter_model.safetensors").write_bytes(weights)
    digests = {n: xxhash.xxh3_128(b).hexdigest() for n, b in (("adapter_config.json", config),
                                                              ("adapter_model.safetensors", weights))}
    (entry / DIGESTS).write_text(json.dumps({"content_id": cid, "files": digests}))
    got = make_resolver(str(store.storage.root), cache_dir=str(tmp_path / "cache")).resolve(MODEL, "acme/patterned")
    assert got is not None and Path(got.path) == entry
    served = json.loads((entry / "adapter_config.json").read_text())
    assert served["lora_alpha"] / served["r"] == 1.0 and not served.get("use_rslora")
    for m in load_peft_dir(entry, base=BASE).modules:
        assert m.scaling == 1.0
        torch.testing.assert_close(m.b, next(o for o in original.modules if o.name == m.name).b * 2.0)


def test_ids_are_positive_int32_and_collision_free() -> None:
    table = IdTable()
    a = "f" * 32
    b = "f" * 16 + "0" * 16  # same leading 64 bits: same derived id
    assert derived_id(a) == derived_id(b)
    ia, ib = table.id_for(a), table.id_for(b)
    assert ia == derived_id(a) and ib != ia and table.id_for(b) == ib and table.id_for(a) == ia
    assert all(1 <= i <= MAX_LORA_ID for i in (ia, ib, derived_id("0" * 32)))


def test_config_from_env(tmp_path: Path) -> None:
    assert PluginConfig.from_env({}) is None
    c = PluginConfig.from_env({"MINT_SERVER": "http://h:1", "MINT_STORE": "/s", "MINT_TOKEN": "t",
                               "MINT_VLLM_CACHE_DIR": str(tmp_path), "MINT_VLLM_CACHE_BYTES": "1048576",
                               "MINT_VLLM_CACHE_HOLD": "0", "MINT_VLLM_BASE": "qwen3-4b"})
    assert c is not None
    assert (c.url, c.token, c.cache_dir, c.cache_bytes, c.hold, c.base, c.is_remote) == (
        "http://h:1", "t", tmp_path, 1 << 20, False, "qwen3-4b", True)
    local = PluginConfig.from_env({"MINT_STORE": "/s", "MINT_INDEX": "/i"})
    assert local is not None and (local.url, local.index_dir, local.hold, local.is_remote) == ("/s", "/i", True, False)
    for bad in ({"MINT_VLLM_CACHE_BYTES": "10G"}, {"MINT_VLLM_CACHE_BYTES": "-1"},
                {"MINT_VLLM_CACHE_HOLD": "maybe"}, {"MINT_VLLM_BASE": "Qwen/Qwen3"}):
        with pytest.raises(ValueError):
            PluginConfig.from_env({"MINT_STORE": "/s", **bad})
    # addresses without their scheme: refused at startup, naming the variable (a follower that
    # cannot drop names, or a "store" at ./127.0.0.1:8470, would fail only later, per request)
    for env, name in (({"MINT_STORE": "/s", "MINT_VLLM_URL": "localhost:8000"}, "MINT_VLLM_URL"),
                      ({"MINT_SERVER": "127.0.0.1:8470"}, "MINT_SERVER")):
        with pytest.raises(ValueError, match=name):
            PluginConfig.from_env(env)
    ok = PluginConfig.from_env({"MINT_STORE": "/s", "MINT_VLLM_URL": "http://127.0.0.1:8000"})
    assert ok is not None and ok.server_url == "http://127.0.0.1:8000"


def test_config_of_the_load_path_preload_and_warm_up() -> None:
    c = PluginConfig.from_env({"MINT_STORE": "/s"})
    assert c is not None and (c.load, c.preload, c.warm) == ("auto", (), True)
    c = PluginConfig.from_env({"MINT_STORE": "/s", "MINT_VLLM_LOAD": " Files ", "MINT_VLLM_WARM": "0",
                               "MINT_VLLM_PRELOAD": "acme/a:prod, acme/b@2,,sha:" + "0" * 32})
    assert c is not None and (c.load, c.warm) == ("files", False)
    assert c.preload == ("acme/a:prod", "acme/b@2", "sha:" + "0" * 32)
    with pytest.raises(ValueError, match="MINT_VLLM_LOAD must be one of auto, direct, files"):
        PluginConfig.from_env({"MINT_STORE": "/s", "MINT_VLLM_LOAD": "fast"})
    with pytest.raises(ValueError, match="MINT_VLLM_WARM must be 1 or 0"):
        PluginConfig.from_env({"MINT_STORE": "/s", "MINT_VLLM_WARM": "inplace"})
    with pytest.raises(ValueError, match="Acme/A"):  # a preload ref that cannot be one: refused at start
        PluginConfig.from_env({"MINT_STORE": "/s", "MINT_VLLM_PRELOAD": "acme/a,Acme/A"})


def test_the_paths_handed_to_vllm_name_their_content_and_nothing_else(tmp_path: Path) -> None:
    from engine_client.vllm_plugin.paths import content_of, row_path

    cid = "0123456789abcdef0123456789abcdef"
    assert row_path(tmp_path, cid) == str(tmp_path / "rows" / cid)
    assert content_of(tmp_path, row_path(tmp_path, cid)) == (cid, True)
    assert content_of(tmp_path, str(tmp_path / "entries" / cid)) == (cid, False)
    for other in (tmp_path / "rows" / "x", tmp_path / "elsewhere" / cid, tmp_path / "a" / "rows" / cid,
                  Path("/models/rows") / cid):
        assert content_of(tmp_path, str(other)) is None
    with pytest.raises(ValueError):
        row_path(tmp_path, "../etc")


def test_a_direct_resolver_answers_the_row_path_and_writes_no_files(store: Store, peft_dirs: list[Path],
                                                                    tmp_path: Path) -> None:
    from engine_client.vllm_plugin.paths import row_path

    cid = publish(store, "acme", "x", peft_dirs[0])
    config = PluginConfig(url=str(store.storage.root), cache_dir=tmp_path / "cache")
    resolver = MintResolver(config, direct=True)
    try:
        got = resolver.resolve(MODEL, "acme/x")
        assert got is not None and (got.path, got.created, got.content_id) == (row_path(config.cache_dir, cid), False,
                                                                          cid)
        assert resolver.cache is None and not (tmp_path / "cache" / "entries").exists()
    finally:
        resolver.close()


def test_a_direct_resolver_follows_tags_checks_the_base_and_refuses_a_quarantined_row(
        source: Source, peft_dirs: list[Path], make_resolver: ResolverFactory, tmp_path: Path) -> None:
    """The direct lookup (one resolve on the calling thread, the base from the layout) answers
    what the files path answers: the tag's content now, the model's base only, never a damaged row."""
    from engine_client.vllm_plugin.paths import row_path

    url, pub = source
    c1 = publish(pub, "acme", "support", peft_dirs[0], tag="prod")
    c2 = publish(pub, "acme", "support", peft_dirs[1])
    r = make_resolver(url, direct=True)
    for ref, cid in (("acme/support:prod", c1), ("acme/support", c2), ("acme/support@1", c1), (f"sha:{c2}", c2)):
        got = r.resolve(MODEL, ref)
        assert got is not None and (got.content_id, got.path, got.ref, got.base) == (
            cid, row_path(tmp_path / "cache", cid), f"sha:{cid}", BASE), ref
    pub.tag("acme/support@2", "prod")
    moved = r.resolve(MODEL, "acme/support:prod")
    assert moved is not None and moved.content_id == c2
    with pytest.raises(WrongBase, match="acme/support"):
        r.resolve("/models/other", "acme/support")
    store = pub if isinstance(pub, Store) else None
    if store is not None:  # (a service's store is its own process's: the local store shows it)
        store.quarantine([c1])
        with pytest.raises(AdapterUnavailable, match=r"damaged|quarantined"):
            r.resolve(MODEL, "acme/support@1")
    assert not (tmp_path / "cache" / "entries").exists()


def test_a_direct_lookup_that_outlives_a_close_keeps_no_reader_of_the_closed_client(
        source: Source, peft_dirs: list[Path], make_resolver: ResolverFactory) -> None:
    """A lookup took its client, then the resolver closed: it fails as unavailable, and the
    next lookup (on a fresh client) gets a reader of its own, not one of the closed client."""
    url, pub = source
    cid = publish(pub, "acme", "x", peft_dirs[0])
    r = make_resolver(url, direct=True)
    old = r.client
    r.close()
    with pytest.raises(AdapterUnavailable, match="closed during this lookup"):
        r._target(old, "acme/x", "acme/x")
    assert r._reader is None
    got = r.resolve(MODEL, "acme/x")  # reopens: a new client and a reader of it
    assert got is not None and got.content_id == cid
    assert r.client is not old and r._reader is not None
