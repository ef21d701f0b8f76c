"""The cache trusts nothing planted in it: entries need this cache's seal; the directory must be private."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import xxhash

from engine_client.vllm_plugin import AdapterUnavailable
from engine_client.vllm_plugin.cache import DIGESTS, FORMAT, AdapterCache
from engine_client.vllm_plugin.cache_root import KEY_NAME, prepare_root
from engine_client.vllm_plugin.errors import UnsafeCacheDir
from mint_store.peft.directory import load_peft_dir
from mint_store.store import Store
from tests.support.vllm_plugin import BASE, MODEL, ResolverFactory

CIDS = [f"{i:032x}" for i in range(1, 4)]
ROOT = os.geteuid() == 0
OTHER_UID = 12345  # a user that is not this one
as_root = pytest.mark.skipif(not ROOT, reason="making a directory another user owns needs root")


def files(fill: bytes) -> dict[str, bytes]:
    return {"adapter_config.json": b"{}", "adapter_model.safetensors": fill * 98}


def plant(entry: Path, content: dict[str, bytes], content_id: str, **extra: object) -> None:
    """An entry written by someone else, with a digests file that matches its files."""
    entry.mkdir()
    for name, data in content.items():
        (entry / name).write_bytes(data)
    digests = {name: xxhash.xxh3_128(data).hexdigest() for name, data in content.items()}
    (entry / DIGESTS).write_text(json.dumps({"content_id": content_id, "format": FORMAT, "files": digests, **extra}))


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_planted_entry_with_matching_digests_is_not_served(tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path, 10_000)
    cache.get(CIDS[1], lambda: files(b"b"))
    entries = tmp_path / "entries"
    plant(entries / CIDS[0], files(b"x"), CIDS[0])  # digests as an unkeyed cache would check them
    got = cache.get(CIDS[0], lambda: files(b"a"))
    assert got.created and (got.path / "adapter_model.safetensors").read_bytes() == b"a" * 98
    # a forged seal: the right shape and the files' real stat, another key
    doc = json.loads((got.path / DIGESTS).read_text())
    weights = got.path / "adapter_model.safetensors"
    weights.write_bytes(b"x" * 98)
    st = os.stat(weights)
    doc["files"]["adapter_model.safetensors"] = {"xxh3": xxhash.xxh3_128(b"x" * 98).hexdigest(),
                                                 "stat": [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]}
    doc["mac"] = "0" * 64
    (got.path / DIGESTS).write_text(json.dumps(doc))
    assert cache.get(CIDS[0], lambda: files(b"a")).created and weights.read_bytes() == b"a" * 98
    # a sealed entry moved under another content id's name: its seal names the content it holds
    os.rename(entries / CIDS[1], entries / CIDS[2])
    moved = cache.get(CIDS[2], lambda: files(b"c"))
    assert moved.created and (moved.path / "adapter_model.safetensors").read_bytes() == b"c" * 98
    assert not cache.get(CIDS[2], lambda: files(b"c")).created  # sealed now: a plain hit


def test_a_sealed_file_rewritten_in_place_is_checked_against_the_row(tmp_path: Path) -> None:
    """The hit trusts the seal's stat, not a digest someone could match: a file written again, even
    with its very bytes, is compared with the row's files; equal, it is sealed anew, not remade."""
    cache = AdapterCache(tmp_path, 10_000)
    made = []

    def produce() -> dict[str, bytes]:
        made.append(1)
        return files(b"a")

    path = cache.get(CIDS[0], produce).path
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes())  # same bytes, same digest; a new ctime
    again = cache.get(CIDS[0], produce)
    assert not again.created and len(made) == 2 and weights.read_bytes() == b"a" * 98
    assert not cache.get(CIDS[0], produce).created and len(made) == 2  # sealed again: a plain hit


def test_the_resolver_serves_the_rows_adapter_not_a_planted_one(store: Store, peft_dirs: list[Path],
                                                                make_resolver: ResolverFactory,
                                                                tmp_path: Path) -> None:
    """Another adapter's real PEFT files planted under a content id, digests and all: vLLM gets the row's."""
    a = store.publish("acme", "a", load_peft_dir(peft_dirs[0], base=BASE)).content_id
    other = load_peft_dir(peft_dirs[1], base=BASE)
    r = make_resolver(str(store.storage.root))
    r.cache.evict()  # opens the cache directory: made and checked
    planted = {n: (peft_dirs[1] / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    plant(tmp_path / "cache" / "entries" / a, planted, a)
    got = r.resolve(MODEL, "acme/a")
    assert got is not None and got.created
    assert load_peft_dir(got.path, base=BASE).content_id() == a != other.content_id()


def test_a_new_cache_directory_is_private(tmp_path: Path) -> None:
    AdapterCache(tmp_path / "made" / "cache", 10_000)
    root = tmp_path / "made" / "cache"
    assert mode(root) == 0o700
    assert {d: mode(root / d) for d in ("entries", "tmp", "leases")} == dict.fromkeys(("entries", "tmp", "leases"),
                                                                                       0o700)
    assert mode(root / KEY_NAME) == 0o600 and (root / KEY_NAME).stat().st_size == 32


@pytest.mark.parametrize("bits", [0o020, 0o002])
def test_a_cache_directory_others_can_write_is_refused(tmp_path: Path, bits: int) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o700 | bits)
    with pytest.raises(UnsafeCacheDir, match=f"chmod 700 {root}"):
        AdapterCache(root, 10_000)
    assert os.listdir(root) == []  # nothing made in it
    root.chmod(0o700)  # the fix the message names
    AdapterCache(root, 10_000)


def test_a_cache_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if ROOT:
        root = tmp_path / "theirs"
        root.mkdir(mode=0o700)
        os.chown(root, OTHER_UID, -1)
    else:
        root = Path("/")  # root's, and not this user's
    with pytest.raises(UnsafeCacheDir, match=f"owned by uid {os.stat(root).st_uid}, not by this process's uid"):
        AdapterCache(root, 10_000)
    assert not (root / "entries").exists()


def test_the_way_to_the_cache_directory_is_checked_through_symlinks(tmp_path: Path) -> None:
    """A directory above the cache that others may write (not sticky) lets them swap the cache, as
    written (the symlink's own directory) or as resolved (its target's)."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    (open_dir / "real").mkdir(mode=0o700)
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    (safe / "real").mkdir(mode=0o700)
    (open_dir / "link").symlink_to(safe / "real")
    (safe / "to-open").symlink_to(open_dir / "real")
    (safe / "link").symlink_to(safe / "real")
    for root in (open_dir / "link", safe / "to-open", open_dir / "real"):
        with pytest.raises(UnsafeCacheDir, match=f"{open_dir} above it is writable by others"):
            AdapterCache(root, 10_000)
    assert AdapterCache(safe / "link", 10_000).get(CIDS[0], lambda: files(b"a")).created  # a safe symlink: fine
    open_dir.chmod(0o1777)  # sticky, as /tmp: only an entry's owner may rename it
    assert prepare_root(open_dir / "real") == open_dir / "real"


@as_root
def test_a_directory_above_owned_or_writable_by_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, -1)
    (theirs / "cache").mkdir(mode=0o700)
    with pytest.raises(UnsafeCacheDir, match=f"{theirs} above it is owned by uid {OTHER_UID}"):
        AdapterCache(theirs / "cache", 10_000)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, -1, OTHER_UID)  # a group that is not this user's own
    shared.chmod(0o775)
    with pytest.raises(UnsafeCacheDir, match=f"{shared} above it is writable by its group"):
        AdapterCache(shared / "cache", 10_000)


def test_unsafe_things_inside_the_cache_directory_are_refused(tmp_path: Path) -> None:
    AdapterCache(tmp_path / "c", 10_000)
    key = tmp_path / "c" / KEY_NAME
    key.chmod(0o644)  # a key others can read seals nothing
    with pytest.raises(UnsafeCacheDir, match="is not private to uid"):
        AdapterCache(tmp_path / "c", 10_000)
    key.unlink()  # the fix the message names: a new key
    AdapterCache(tmp_path / "c", 10_000)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    os.rmdir(tmp_path / "c" / "tmp")
    (tmp_path / "c" / "tmp").symlink_to(elsewhere)
    with pytest.raises(UnsafeCacheDir, match="is not a directory"):
        AdapterCache(tmp_path / "c", 10_000)
    (tmp_path / "c" / "tmp").unlink()
    (tmp_path / "c" / "entries").chmod(0o777)
    with pytest.raises(UnsafeCacheDir, match="chmod 700"):
        AdapterCache(tmp_path / "c", 10_000)


def test_the_resolver_answers_an_unsafe_cache_directory_with_the_fix(store: Store, peft_dirs: list[Path],
                                                                     make_resolver: ResolverFactory,
                                                                     tmp_path: Path) -> None:
    store.publish("acme", "a", load_peft_dir(peft_dirs[0], base=BASE))
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    r = make_resolver(str(store.storage.root), cache_dir=tmp_path / "open")
    with pytest.raises(AdapterUnavailable, match="chmod 700"):
        r.resolve(MODEL, "acme/a")
