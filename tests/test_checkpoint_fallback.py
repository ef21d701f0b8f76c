"""Every parse error of a checkpoint falls back to an older checkpoint, or to the log (security
review, finding 3).

The manifest's hash is unkeyed: whoever can write the manifest can recompute it. The reported
case: a manifest without ``parts`` and a recomputed hash raised KeyError out of the replica's
open. Each malformation here gets its hash recomputed (except the ones that are no JSON), so
the shape checks, not the hash, must reject it. Real stores, real replicas.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mint_store.index.checkpoint import _manifest_hash, checkpoint_problems, collect_checkpoints, manifest_key
from mint_store.storage import Storage
from tests.support.factories import random_adapter
from tests.support.targets import StoreTarget
from tests.test_replicas import replica_of, same_view

QUIET = {"checkpoint_every": 10**6, "checkpoint_interval_s": 10**6}  # checkpoints only where a test writes one
Body = dict[str, Any]


def _rehashed(mutate: Callable[[Body], None]) -> Callable[[bytes], bytes]:
    def rewrite(raw: bytes) -> bytes:
        body = json.loads(raw)
        mutate(body)
        body["hash"] = _manifest_hash(body)
        return json.dumps(body).encode()
    return rewrite


def _set(path: str, value: Any) -> Callable[[bytes], bytes]:
    """Set (or, with ``...``, delete) ``path`` ("parts.0.key") of the manifest, hash recomputed."""
    def mutate(body: Body) -> None:
        *head, last = path.split(".")
        node: Any = body
        for step in head:
            node = node[int(step)] if isinstance(node, list) else node[step]
        key: Any = int(last) if isinstance(node, list) else last
        if value is ...:
            del node[key]
        else:
            node[key] = value
    return _rehashed(mutate)


def _deep(raw: bytes) -> bytes:
    return b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


MALFORMED: dict[str, Callable[[bytes], bytes]] = {
    "not JSON": lambda raw: raw[: len(raw) // 2],
    "not an object": lambda raw: b"[1, 2, 3]",
    "NaN": lambda raw: raw.replace(b'"created":', b'"created": NaN, "was":', 1),
    "nested past any limit": _deep,
    "parts missing (the report)": _set("parts", ...),
    "counts missing": _set("counts", ...),
    "parts not a list": _set("parts", "parts"),
    "parts empty": _set("parts", []),
    "a part not an object": _set("parts.0", 7),
    "a part without a key": _set("parts.0.key", ...),
    "a part key of another type": _set("parts.0.key", 12),
    "a part key outside the checkpoint": _set("parts.0.key", "store.id"),
    "a byte count as text": _set("parts.0.bytes", "100"),
    "a byte count that is a bool": _set("parts.0.bytes", True),
    "a negative byte count": _set("parts.0.bytes", -1),
    "a part without its hash": _set("parts.0.xxh3", ...),
    "a part hash of another type": _set("parts.0.xxh3", ["00"]),
    "counts not an object": _set("counts", [1, 2]),
    "a count as text": _set("counts.versions", "3"),
    "a count of an unknown database": _set("counts.nope", 1),
    "seq as text": _set("seq", "2"),
    "store_id of another type": _set("store_id", 5),
    "format missing": _set("format", ...),
}


def _malform(storage: Storage, seq: int, how: Callable[[bytes], bytes]) -> None:
    storage.put(manifest_key(seq), how(storage.get(manifest_key(seq))))


def _two_checkpoints(target: StoreTarget) -> tuple[Any, int, int]:
    writer = target.open(**QUIET)
    writer.publish("acme", "a", random_adapter(1))
    old = writer.checkpoint()
    writer.tag("acme/a@1", "prod")
    writer.publish("acme", "b", random_adapter(2))
    return writer, old, writer.checkpoint()


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_checkpoint_falls_back_to_an_older_one(local_target: StoreTarget, tmp_path: Path,
                                                           kind: str) -> None:
    writer, old, new = _two_checkpoints(local_target)
    with writer:
        _malform(writer.storage, new, MALFORMED[kind])
        with replica_of(local_target, str(tmp_path / "r"), follow_interval_s=0) as replica:
            stats = replica.replica_stats
            assert stats.checkpoint_seq == old
            assert len(stats.rejected_checkpoints) == 1 and stats.rejected_checkpoints[0].startswith(f"{new}: ")
            same_view(writer, replica)
        # what fsck and sweep read of it: a reported problem, never a crash
        assert any(manifest_key(new) in p for p in checkpoint_problems(writer.storage, store_id=None))
        collect_checkpoints(writer.storage, keep=2)


def test_the_reported_manifest_falls_back_to_the_log(target: StoreTarget, tmp_path: Path) -> None:
    """The only checkpoint lacks ``parts`` (hash recomputed): the replica replays the whole log."""
    with target.open(**QUIET) as writer:
        writer.publish("acme", "a", random_adapter(1))
        writer.tag("acme/a@1", "prod")
        only = writer.checkpoint()
        _malform(writer.storage, only, _set("parts", ...))
        with replica_of(target, str(tmp_path / "r"), follow_interval_s=0) as replica:
            assert replica.replica_stats.checkpoint_seq is None
            assert "parts" in replica.replica_stats.rejected_checkpoints[0]
            same_view(writer, replica)


def test_a_writer_opening_an_empty_index_skips_a_malformed_checkpoint(local_target: StoreTarget,
                                                                      tmp_path: Path) -> None:
    """The writer's own open loads the newest checkpoint into an empty index: the same fallback."""
    writer, _, new = _two_checkpoints(local_target)
    with writer:
        _malform(writer.storage, new, _set("parts", ...))
        want = [v.to_dict() for v in writer.iter_versions()]
    fresh = dataclasses.replace(local_target, index_dir=str(tmp_path / "other-index"))
    with fresh.open(**QUIET) as again:
        assert [v.to_dict() for v in again.iter_versions()] == want



def _plant_in_checkpoint(storage: Storage, seq: int, db: str,
                         change: Callable[[bytes, Any], tuple[bytes, Any]]) -> None:
    """Rewrite every record of ``db`` in checkpoint ``seq``'s parts through ``change``, every
    hash recomputed (they are unkeyed: whoever can write the store can)."""
    import msgpack
    import xxhash

    from mint_store.index.lmdb_index import decode, encode

    body = json.loads(storage.get(manifest_key(seq)))
    for part in body["parts"]:
        out = bytearray()
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(storage.get(part["key"]))
        for name, flat in unpacker:
            if name == db:
                pairs = [change(bytes(k), decode(db, v)) for k, v in zip(flat[::2], flat[1::2], strict=True)]
                flat = [x for k, v in sorted(pairs) for x in (k, encode(db, v))]
            out += msgpack.packb([name, flat], use_bin_type=True)
        storage.put(part["key"], bytes(out))
        part.update(bytes=len(out), xxh3=xxhash.xxh3_128_hexdigest(out))
    body["hash"] = _manifest_hash(body)
    storage.put(manifest_key(seq), json.dumps(body).encode())


OUTSIDE_KEYS = {"blobs": lambda key, rec: (key, {**rec, "shard": "/etc/passwd"}),
                "shards": lambda key, rec: (key + b"/../../../../../tokens.json", rec)}


@pytest.mark.parametrize("db", sorted(OUTSIDE_KEYS))
def test_a_checkpoint_naming_a_key_outside_the_store_falls_back(local_target: StoreTarget, tmp_path: Path,
                                                                db: str) -> None:
    """A checkpoint whose records place a row at a path outside the store (every hash
    recomputed) is rejected as corrupt, as a planted log event is: an older one is loaded."""
    writer, old, new = _two_checkpoints(local_target)
    with writer:
        _plant_in_checkpoint(writer.storage, new, db, OUTSIDE_KEYS[db])
        with replica_of(local_target, str(tmp_path / "r"), follow_interval_s=0) as replica:
            stats = replica.replica_stats
            assert stats.checkpoint_seq == old
            assert "names keys the writer never writes" in stats.rejected_checkpoints[0]
            same_view(writer, replica)
            with replica.index_snapshot() as t:
                assert all(rec["shard"].startswith("packs/") for _, rec in t.scan("blobs"))
