"""AdapterCache: PEFT directories keyed by content id, atomic, LRU by bytes, leases."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engine_client.vllm_plugin.cache import AdapterCache

CIDS = [f"{i:032x}" for i in range(1, 10)]


def files(size: int, fill: bytes = b"w") -> dict[str, bytes]:
    return {"adapter_config.json": b"{}", "adapter_model.safetensors": fill * (size - 2)}


def entries(cache: AdapterCache) -> set[str]:
    return {e.content_id for e in cache.entries()}


def tick(root: Path) -> None:
    """Age every entry by 10 s: whatever is used next is strictly the most recent (no sleeps)."""
    for path in (root / "entries").iterdir():
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns - 10**10, st.st_mtime_ns - 10**10))


def test_keyed_by_content_id_materialised_once(tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path, 10_000)
    calls = []

    def produce() -> dict[str, bytes]:
        calls.append(1)
        return files(100)

    first = cache.get(CIDS[0], produce)
    again = cache.get(CIDS[0], produce)
    assert first.created and not again.created
    assert first.path == again.path == tmp_path / "entries" / CIDS[0]
    assert len(calls) == 1 and first.nbytes == again.nbytes == 100
    assert sorted(os.listdir(first.path)) == [".mint-digests.json", "adapter_config.json", "adapter_model.safetensors"]
    with pytest.raises(ValueError):
        cache.get("not-a-content-id", produce)


def test_concurrent_gets_of_one_content_materialise_once(tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path, 10_000)
    calls = []
    gate = threading.Barrier(8)

    def produce() -> dict[str, bytes]:
        calls.append(1)
        time.sleep(0.05)
        return files(100)

    got: list[object] = []

    def worker() -> None:
        gate.wait()
        try:
            got.append(cache.get(CIDS[0], produce).path)
        except BaseException as e:  # kept: an error in a thread would otherwise only warn
            got.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [tmp_path / "entries" / CIDS[0]] * 8  # every caller got the entry, none an error
    assert len(calls) == 1 and entries(cache) == {CIDS[0]}


def test_two_caches_racing_keep_one_copy(tmp_path: Path) -> None:
    """Two processes that both miss: both write, the first rename wins, the other discards its copy."""
    a, b = AdapterCache(tmp_path, 10_000), AdapterCache(tmp_path, 10_000)

    def produce_b() -> dict[str, bytes]:
        return files(100, b"b")

    def produce_a() -> dict[str, bytes]:
        assert b.get(CIDS[0], produce_b).created  # b wins while a is still producing
        return files(100, b"a")

    got = a.get(CIDS[0], produce_a)
    assert not got.created
    assert (got.path / "adapter_model.safetensors").read_bytes() == b"b" * 98
    assert entries(a) == {CIDS[0]} and os.listdir(tmp_path / "tmp") == []


def test_failed_materialisation_leaves_nothing(tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path, 10_000)

    def boom() -> dict[str, bytes]:
        raise ConnectionError("store went away")

    with pytest.raises(ConnectionError):
        cache.get(CIDS[0], boom)
    assert entries(cache) == set() and cache.held() == set() and os.listdir(tmp_path / "tmp") == []


def test_a_crash_mid_write_never_leaves_a_loadable_entry(tmp_path: Path) -> None:
    """A process dies between writing the config and the weights: no entry; the debris is swept."""
    child = textwrap.dedent(f"""
        import os
        from collections.abc import Mapping
        from engine_client.vllm_plugin.cache import AdapterCache

        class DiesMidway(Mapping):
            def __getitem__(self, k): raise KeyError(k)
            def __len__(self): return 2
            def __iter__(self): return iter(["adapter_config.json", "adapter_model.safetensors"])
            def items(self):
                yield "adapter_config.json", b"{{}}"
                os._exit(3)

        AdapterCache({str(tmp_path)!r}, 10_000).get({CIDS[0]!r}, DiesMidway)
    """)
    proc = subprocess.run([sys.executable, "-c", child], timeout=60, capture_output=True)
    assert proc.returncode == 3, proc.stderr.decode()
    (debris,) = os.listdir(tmp_path / "tmp")
    assert os.listdir(tmp_path / "tmp" / debris) == ["adapter_config.json"]
    assert os.listdir(tmp_path / "entries") == []

    cache = AdapterCache(tmp_path, 10_000, tmp_grace_s=0.0)
    got = cache.get(CIDS[0], lambda: files(100))  # materialises afresh, sweeps the debris
    assert got.created and got.nbytes == 100
    assert os.listdir(tmp_path / "tmp") == []


def test_lru_eviction_by_bytes(tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path, 300, hold=False)
    for cid in CIDS[:3]:
        cache.get(cid, lambda: files(100))
        tick(tmp_path)
    assert cache.total_bytes() == 300
    cache.get(CIDS[0], lambda: files(100))  # a hit makes it the most recent
    tick(tmp_path)
    cache.get(CIDS[3], lambda: files(100))  # 400 > 300: the least recently used goes
    assert entries(cache) == {CIDS[0], CIDS[2], CIDS[3]}
    tick(tmp_path)
    cache.get(CIDS[4], lambda: files(150))  # 450: the two least recent go
    assert entries(cache) == {CIDS[3], CIDS[4]} and cache.total_bytes() == 250
    assert cache.held() == set()  # without hold, a lease lasts one call
    (lease,) = os.listdir(tmp_path / "leases")
    assert (tmp_path / "leases" / lease).read_bytes() == b""


def test_the_entry_of_the_call_is_never_evicted(tmp_path: Path) -> None:
    cache = AdapterCache(tmp_path, 100, hold=False)
    cache.get(CIDS[0], lambda: files(50))
    big = cache.get(CIDS[1], lambda: files(500))  # over the limit by itself
    assert big.path.is_dir() and entries(cache) == {CIDS[1]}


def test_held_entries_are_not_evicted_until_released(tmp_path: Path) -> None:
    """vLLM reloads from the returned path: a live holder keeps it; close() releases it."""
    holder = AdapterCache(tmp_path, 250)
    holder.get(CIDS[0], lambda: files(100))
    holder.get(CIDS[1], lambda: files(100))
    other = AdapterCache(tmp_path, 250)  # another process, as far as flock is concerned
    tick(tmp_path)
    other.get(CIDS[2], lambda: files(100))
    assert entries(other) == {CIDS[0], CIDS[1], CIDS[2]}  # over the limit: the rest is held
    assert holder.held() == {CIDS[0], CIDS[1]}
    holder.close()
    tick(tmp_path)
    other.get(CIDS[3], lambda: files(100))  # now the holder's entries can go, oldest first
    assert entries(other) == {CIDS[2], CIDS[3]}


def test_a_dead_holders_leases_lapse(tmp_path: Path) -> None:
    child = f"""
from engine_client.vllm_plugin.cache import AdapterCache
AdapterCache({str(tmp_path)!r}, 150).get({CIDS[0]!r}, lambda: {{"adapter_model.safetensors": b"x" * 100}})
"""
    subprocess.run([sys.executable, "-c", child], timeout=60, check=True)  # exits holding a lease
    assert len(os.listdir(tmp_path / "leases")) == 1
    cache = AdapterCache(tmp_path, 150)
    tick(tmp_path)
    cache.get(CIDS[1], lambda: files(100))
    assert entries(cache) == {CIDS[1]}
    assert os.listdir(tmp_path / "leases") == [cache._lease_name]


def test_hits_refresh_recency_across_instances(tmp_path: Path) -> None:
    a = AdapterCache(tmp_path, 200, hold=False)
    b = AdapterCache(tmp_path, 200, hold=False)
    a.get(CIDS[0], lambda: files(100))
    tick(tmp_path)
    a.get(CIDS[1], lambda: files(100))
    tick(tmp_path)
    b.get(CIDS[0], lambda: files(100))  # b uses the older one
    tick(tmp_path)
    b.get(CIDS[2], lambda: files(100))
    assert entries(a) == {CIDS[0], CIDS[2]}


def test_a_hit_whose_files_changed_on_disk_is_made_again(tmp_path: Path) -> None:
    """Every hit checks the files against the digests written with them: a flipped byte, a
    truncated file, a missing digests file (an entry of an older version) or a stray file is
    not returned to vLLM; the entry is made again from the (checked) row (an older entry without
    digests, whose files are the row's, gets its digests instead)."""
    cache = AdapterCache(tmp_path, 10_000)
    made = []

    def produce() -> dict[str, bytes]:
        made.append(1)
        return files(100)

    path = cache.get(CIDS[0], produce).path
    weights = path / "adapter_model.safetensors"

    def flip() -> None:
        data = bytearray(weights.read_bytes())
        data[50] ^= 1
        weights.write_bytes(bytes(data))

    def legacy() -> None:  # an entry an older version wrote: no digests file, sound files
        (path / ".mint-digests.json").unlink()

    for damage, remade in ((flip, True), (lambda: weights.write_bytes(b"w" * 10), True), (legacy, False),
                           (lambda: (path / "extra.bin").write_bytes(b"x"), True)):
        damage()
        again = cache.get(CIDS[0], produce)
        assert again.created is remade and again.path == path  # a legacy entry holding the row's files: kept
        assert weights.read_bytes() == files(100)["adapter_model.safetensors"]
        assert sorted(os.listdir(path)) == [".mint-digests.json", "adapter_config.json", "adapter_model.safetensors"]
    assert len(made) == 5  # each check against the row's files made them once
    assert not cache.get(CIDS[0], produce).created and len(made) == 5  # intact: a plain hit
    (path / ".mint-digests.json").unlink()
    flip()  # an older entry whose files are not the row's: made again
    assert cache.get(CIDS[0], produce).created and weights.read_bytes() == files(100)["adapter_model.safetensors"]


def test_an_entry_of_an_older_format_holding_what_this_one_makes_is_kept(tmp_path: Path) -> None:
    """Entries of another export format are made again, unless their bytes are already what this
    format makes (most adapters need no fold): those keep their directory, digests brought up."""
    import json

    from engine_client.vllm_plugin.cache import DIGESTS, FORMAT

    cache = AdapterCache(tmp_path, 10_000)
    first = cache.get(CIDS[0], lambda: files(100))
    doc = json.loads((first.path / DIGESTS).read_text())
    (first.path / DIGESTS).write_text(json.dumps({k: v for k, v in doc.items() if k != "format"}))  # format 1
    again = cache.get(CIDS[0], lambda: files(100))
    assert not again.created and json.loads((first.path / DIGESTS).read_text())["format"] == FORMAT
