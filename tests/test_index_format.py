"""The LMDB index holds msgpack records, never pickle; an index of the pickle era is rebuilt
from the commit log without one of its records being decoded."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import lmdb
import pytest

from mint_store.errors import IndexFormatMismatch
from mint_store.index.lmdb_index import _DBS, INDEX_FORMAT, dumps, loads
from mint_store.store import Store
from tests.support.factories import random_adapter


class Detonator:
    """Unpickling this creates ``path``: proof that something ran pickle.loads."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


@pytest.mark.parametrize("record", [
    {"next": 3, "latest": 2, "latest_cid": "ab" * 32},
    {"next": 1, "latest": None, "latest_cid": None},
    {"layout_id": "0" * 32, "row": 7, "shard": "packs/x/rows/c/0/0", "offset": 4096, "length": 512, "refs": 1,
     "state": "ok"},
    {"tenant": "acme", "name": "a", "version": 1, "created": 1733000000.123456, "deleted": False,
     "peft_config": {"r": 8, "lora_alpha": 16.5, "target_modules": ["q_proj", "v_proj"], "big": 2**70,
                     "neg": -(2**80), "text": "caf\u00e9 \ud800", "nested": {"x": [1, [2, None]]}}},
    {"model.layers.0.q_proj": [32, 32], "model.layers.0.mlp.experts": [32, 64, 4]},
    12345678901234,
    0,
])
def test_records_round_trip_exactly_and_are_not_pickle(record: Any) -> None:
    data = dumps(record)
    assert loads(data) == record and type(loads(data)) is type(record)
    assert not data.startswith(b"\x80")  # a pickle (protocol 2+) starts with PROTO
    assert loads(None) is None


def test_tuples_come_back_as_lists_as_they_do_from_the_json_log() -> None:
    assert loads(dumps({"tags": ("a", "b"), "shape": (1, 2)})) == {"tags": ["a", "b"], "shape": [1, 2]}


def _write_pickle_era_index(db: Path, marker: Path) -> None:
    """Rewrite every value of every database the way format 2 stored them: pickles. Every
    record but ``meta/format`` is a pickle whose loading would create ``marker``."""
    env = lmdb.open(str(db), max_dbs=len(_DBS) + 2, subdir=True)
    try:
        dbs = {name: env.open_db(name.encode()) for name in _DBS}
        with env.begin(write=True) as txn:
            for handle in dbs.values():
                keys = [bytes(k) for k, _ in txn.cursor(db=handle)]
                for key in keys:
                    txn.put(key, pickle.dumps(Detonator(str(marker)), protocol=5), db=handle)
            txn.put(b"format", pickle.dumps(2, protocol=5), db=dbs["meta"])
            txn.put(b"last_seq", pickle.dumps(Detonator(str(marker)), protocol=5), db=dbs["meta"])
            txn.put(b"acme/a", pickle.dumps(Detonator(str(marker)), protocol=5), db=dbs["names"])
    finally:
        env.close()


def test_a_pickle_era_index_is_rebuilt_from_the_log_and_never_unpickled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, index_dir = tmp_path / "store", str(tmp_path / "index")
    a, b = random_adapter(1), random_adapter(2)
    with Store.open(url, index_dir=index_dir) as store:
        store.publish("acme", "a", a, tag="prod")
        store.publish("acme", "b", b)
        store.delete("acme/b")
        want = {ref: store.resolve(ref) for ref in ("acme/a", "acme/a:prod", "acme/a@1")}
        want_versions = [v.to_dict() for v in store.iter_versions()]
    marker = tmp_path / "unpickled"
    _write_pickle_era_index(Path(index_dir) / "db", marker)

    with pytest.raises(IndexFormatMismatch, match=r"format 2 \(pickled records\)"):
        Store.open(url, index_dir=index_dir, readonly=True)  # a reader cannot rebuild: it says so
    assert not marker.exists()

    with caplog.at_level(logging.WARNING, logger="mint.index"), Store.open(url, index_dir=index_dir) as store:
        assert {ref: store.resolve(ref) for ref in want} == want
        assert [v.to_dict() for v in store.iter_versions()] == want_versions
        assert store.last_seq == 3
        assert store.publish("acme", "c", random_adapter(3)).seq == 4
    assert not marker.exists()
    assert any("pickled records" in r.getMessage() and "rebuilding it from the commit log" in r.getMessage()
               for r in caplog.records)
    with Store.open(url, index_dir=index_dir, readonly=True) as again:  # rebuilt: current format
        assert again.last_seq == 4
    env = lmdb.open(str(Path(index_dir) / "db"), max_dbs=len(_DBS) + 2, subdir=True, readonly=True)
    try:
        meta = env.open_db(b"meta")
        with env.begin() as txn:
            assert txn.get(b"format", db=meta) == dumps(INDEX_FORMAT)
            assert txn.get(b"last_seq", db=meta) == dumps(4)
    finally:
        env.close()


def test_every_database_round_trips_its_records_and_resolve_rows_are_arrays(tmp_path: Path) -> None:
    from mint_store.index.lmdb_index import ROWS, Index, version_key

    records = {
        "names": {"next": 3, "latest": None, "latest_cid": None},
        "tags": {"version": 2, "content_id": "cd" * 32},
        "blobs": {"layout_id": "0" * 32, "row": 7, "shard": "packs/x/rows/c/0/0", "offset": 4096, "length": 512,
                  "refs": 0, "state": "damaged"},
        "shards": {"layout_id": "0" * 32, "live": 1, "total": 2, "retired_at": 1.5},
        "versions": {"tenant": "acme", "name": "a", "version": 1, "peft_config": {"r": 2**65}},
        "owners": 2,
        "bases": {"m.q_proj": [32, 32]},
    }
    index = Index.acquire(tmp_path / "db")
    try:
        with index.write() as t:
            for db, rec in records.items():
                t.put(db, b"k", rec)
            t.put("blobs", b"odd", {**records["blobs"], "extra": True})  # another shape: kept as a map
        with index.read() as t:
            for db, rec in records.items():
                assert t.get(db, b"k") == rec and list(t.scan(db, b"k")) == [(b"k", rec)]
            assert t.get("blobs", b"odd") == {**records["blobs"], "extra": True}
            for db, fields in ROWS.items():
                raw = t.txn.get(b"k", db=t.dbs[db])
                assert loads(raw) == [records[db][f] for f in fields]  # positional, no key strings
                assert t.row(db, b"k") == [records[db][f] for f in fields]
            assert t.row("blobs", b"odd") == [records["blobs"][f] for f in ROWS["blobs"]]
            assert t.row("names", b"missing") is None
            assert version_key("a", "b", 1).endswith(b"\x00" * 7 + b"\x01")
    finally:
        index.release()


def test_the_fast_location_constructor_builds_the_same_frozen_location() -> None:
    from dataclasses import FrozenInstanceError

    from mint_store.results import Location, make_location

    fast, slow = make_location("c" * 64, "l" * 32, "packs/x/rows/c/0/0", 16, 32, 2), Location(
        "c" * 64, "l" * 32, "packs/x/rows/c/0/0", 16, 32, 2)
    assert fast == slow and hash(fast) == hash(slow) and fast.to_dict() == slow.to_dict()
    with pytest.raises(FrozenInstanceError):
        fast.offset = 0  # type: ignore[misc]
