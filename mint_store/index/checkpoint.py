"""Index checkpoints: the LMDB index at one log position, as record files in the store.

    checkpoints/<seq:020d>/<attempt>-<n:05d>.rec   parts: msgpack stream of [db, [k, v, k, v, ...]]
    checkpoints/<seq:020d>/manifest.json           written last, create-only

A checkpoint exists once its manifest does. It is dumped from one LMDB read transaction,
so it is exactly the fold of log objects 1..seq (``seq`` is that snapshot's ``last_seq``):
a replica loads it and replays only the log after it. Values are the index's own msgpack
records (format 3) copied byte for byte -- never pickle. Each part's size and xxh3-128 and
the manifest's own hash are checked on read; a checkpoint that fails any check raises
:class:`CheckpointCorrupt` and the reader falls back to an older one (or to the full log).
The hash is unkeyed (anyone who can write the manifest can recompute it), so the manifest's
shape is checked too, and any parse error while loading (a missing key, a wrong type) is a
CheckpointCorrupt as well: a malformed checkpoint is never more than a rejected one.
Parts are bounded (``PART_BYTES``) so neither side ever holds the whole index in memory.
The attempt prefix keeps two writers (or a crashed attempt) from colliding on a part name;
parts no manifest names are removed by :func:`collect_checkpoints` (``mint sweep``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lmdb
import msgpack
import xxhash

from ..errors import BlobNotFound, IntegrityError, ObjectExists
from ..format import strict_json
from ..format.keys import bad_index_keys
from ..storage import Storage
from .lmdb_index import INDEX_FORMAT, Index, decode, dumps

log = logging.getLogger("mint.checkpoint")

CHECKPOINT_PREFIX = "checkpoints/"
CHECKPOINT_FORMAT = 1
PART_BYTES = 64 * 2**20
_BATCH = 4096  # records per msgpack batch: big enough to amortise, small enough to stream
_SKIP = ("meta",)  # bookkeeping: the loader writes format, last_seq and store id itself


class CheckpointCorrupt(IntegrityError):
    """A checkpoint failed its hash, size, count or format checks; it is never loaded."""

    code = "checkpoint_corrupt"


def checkpoint_dir(seq: int) -> str:
    return f"{CHECKPOINT_PREFIX}{seq:020d}/"


def manifest_key(seq: int) -> str:
    return checkpoint_dir(seq) + "manifest.json"


def _manifest_hash(body: dict[str, Any]) -> str:
    canon = json.dumps({k: v for k, v in body.items() if k != "hash"}, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(canon.encode())


def _seq_of(key: str) -> int | None:
    rest = key[len(CHECKPOINT_PREFIX):]
    head = rest.split("/", 1)[0]
    return int(head) if len(head) == 20 and head.isascii() and head.isdigit() else None  # "²" is a digit too


def list_checkpoints(storage: Storage) -> list[int]:
    """Seqs of complete checkpoints (those with a manifest), oldest first. One listing."""
    out = [s for k in storage.list(CHECKPOINT_PREFIX) if k.endswith("/manifest.json") and (s := _seq_of(k))]
    return sorted(out)


# -- writing -------------------------------------------------------------------------------


def write_checkpoint(storage: Storage, index: Index, *, store_id: str | None,
                     part_bytes: int = PART_BYTES) -> int:
    """Dump ``index`` (one read snapshot) as a checkpoint; returns the seq it covers.

    Idempotent: a checkpoint of that seq already in the store is left as it is.
    """
    with index.read() as t:
        seq = t.last_seq
        if storage.exists(manifest_key(seq)):
            return seq
        attempt = uuid.uuid4().hex[:12]
        parts: list[dict[str, Any]] = []
        counts: dict[str, int] = {}
        buf = bytearray()
        pack = msgpack.Packer(use_bin_type=True).pack

        def flush() -> None:
            key = f"{checkpoint_dir(seq)}{attempt}-{len(parts):05d}.rec"
            storage.create(key, bytes(buf))
            parts.append({"key": key, "bytes": len(buf), "xxh3": xxhash.xxh3_128_hexdigest(buf)})
            buf.clear()

        for db in sorted(t.dbs):
            if db in _SKIP:
                continue
            counts[db] = 0
            for batch in _batches(t.txn, t.dbs[db]):
                counts[db] += len(batch) // 2
                buf += pack([db, batch])
                if len(buf) >= part_bytes:
                    flush()
        if buf or not parts:
            flush()
    body: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "index_format": INDEX_FORMAT, "seq": seq,
                            "store_id": store_id, "created": time.time(), "parts": parts, "counts": counts}
    body["hash"] = _manifest_hash(body)
    try:
        storage.create(manifest_key(seq), json.dumps(body, separators=(",", ":")).encode())
    except ObjectExists:  # another writer checkpointed the same seq: the same fold of the same log
        pass
    return seq


def _batches(txn: lmdb.Transaction, db: Any) -> Iterator[list[bytes]]:
    with txn.cursor(db=db) as cur:
        batch: list[bytes] = []
        for k, v in cur:
            batch.append(bytes(k))
            batch.append(bytes(v))
            if len(batch) >= 2 * _BATCH:
                yield batch
                batch = []
        if batch:
            yield batch


# -- reading -------------------------------------------------------------------------------


def read_manifest(storage: Storage, seq: int, *, store_id: str | None) -> dict[str, Any]:
    """The manifest of checkpoint ``seq``, checked; CheckpointCorrupt if it fails a check."""
    key = manifest_key(seq)
    try:
        body = strict_json.loads(storage.get(key))  # bounded: NaN, 1e400 or deep nesting is corrupt too
    except BlobNotFound:
        raise CheckpointCorrupt(f"checkpoint {key} is gone (collected by a sweep)") from None
    except ValueError as e:
        raise CheckpointCorrupt(f"checkpoint {key} is not valid JSON: {e}") from None
    if not isinstance(body, dict) or body.get("hash") != _manifest_hash(body):
        raise CheckpointCorrupt(f"checkpoint {key}: the manifest's hash does not match its contents")
    if (problem := _shape_problem(body, seq)) is not None:
        raise CheckpointCorrupt(f"checkpoint {key}: {problem}")
    if body.get("format") != CHECKPOINT_FORMAT or body.get("index_format") != INDEX_FORMAT:
        raise CheckpointCorrupt(f"checkpoint {key} has format {body.get('format')}/index format "
                                f"{body.get('index_format')}; this build reads {CHECKPOINT_FORMAT}/{INDEX_FORMAT}")
    if body.get("seq") != seq:
        raise CheckpointCorrupt(f"checkpoint {key} names seq {body.get('seq')}")
    if store_id is not None and body.get("store_id") not in (None, store_id):
        raise CheckpointCorrupt(f"checkpoint {key} belongs to store {body.get('store_id')}, not {store_id}")
    return body


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _shape_problem(body: dict[str, Any], seq: int) -> str | None:
    """What is wrong with the fields a loader reads (None: nothing), as write_checkpoint writes them."""
    if body.get("store_id") is not None and not isinstance(body.get("store_id"), str):
        return "store_id is not a string"
    parts, counts = body.get("parts"), body.get("counts")
    if not isinstance(parts, list) or not parts:
        return "parts is not a non-empty list"
    for i, p in enumerate(parts):
        if not isinstance(p, dict):
            return f"part {i} is not an object"
        key, xxh3 = p.get("key"), p.get("xxh3")
        if not (isinstance(key, str) and key.startswith(checkpoint_dir(seq)) and key.endswith(".rec")
                and "/" not in key[len(checkpoint_dir(seq)):]):
            return f"part {i} names {key!r}, not a part of this checkpoint"
        if not _is_count(p.get("bytes")):
            return f"part {i} has no byte count"
        if not (isinstance(xxh3, str) and len(xxh3) == 32 and all(c in "0123456789abcdef" for c in xxh3)):
            return f"part {i} has no xxh3-128 hex digest"
    if not isinstance(counts, dict) or not all(isinstance(db, str) and _is_count(n) for db, n in counts.items()):
        return "counts is not an object of record counts"
    return None


def _part(storage: Storage, part: dict[str, Any]) -> bytes:
    try:
        data = storage.get(part["key"])
    except BlobNotFound:
        raise CheckpointCorrupt(f"checkpoint part {part['key']} is missing") from None
    if len(data) != part["bytes"] or xxhash.xxh3_128_hexdigest(data) != part["xxh3"]:
        raise CheckpointCorrupt(f"checkpoint part {part['key']} does not match its hash (corrupt or torn)")
    return data


def load_checkpoint(storage: Storage, seq: int, index: Index, *, store_id: str | None,
                    parallel: int = 4) -> dict[str, Any]:
    """Replace everything in ``index`` with checkpoint ``seq``, in one write transaction.

    Readers of the index see the old state until the commit, then the checkpoint's. On any
    failed check nothing changes (the transaction aborts). Returns the manifest.
    """
    manifest = read_manifest(storage, seq, store_id=store_id)
    try:
        _load(storage, seq, index, manifest, store_id=store_id, parallel=parallel)
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # the shape check missed one: still corrupt
        raise CheckpointCorrupt(f"checkpoint {manifest_key(seq)} does not parse: {e!r}") from None
    return manifest


def _load(storage: Storage, seq: int, index: Index, manifest: dict[str, Any], *, store_id: str | None,
          parallel: int) -> None:
    with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="mint-ckpt") as pool:
        datas = pool.map(lambda p: _part(storage, p), manifest["parts"])  # downloads overlap the load
        with index.write() as w:
            for db in w.dbs:
                w.txn.drop(w.dbs[db], delete=False)
            for data in datas:
                _load_part(w.txn, w.dbs, data)
            for db, n in manifest["counts"].items():
                if db not in w.dbs or w.txn.stat(w.dbs[db])["entries"] != n:
                    raise CheckpointCorrupt(f"checkpoint {manifest_key(seq)}: database {db!r} does not hold "
                                            f"the {n} records its manifest counts")
            # a checkpoint is data anyone who can write the store could have planted (its hash is
            # unkeyed): every shard key it names must be one the writer produces, as for log events
            bad = bad_index_keys(_records(w.txn, w.dbs, "shards"), _records(w.txn, w.dbs, "blobs"))
            if bad:
                raise CheckpointCorrupt(f"checkpoint {manifest_key(seq)} names keys the writer never writes "
                                        f"({len(bad)}; first: {bad[0]}): corrupt or planted")
            meta = w.dbs["meta"]
            w.txn.put(b"format", dumps(INDEX_FORMAT), db=meta)
            w.txn.put(b"last_seq", dumps(seq), db=meta)
            if store_id is not None:
                w.txn.put(b"store_id", dumps(store_id), db=meta)


def _records(txn: lmdb.Transaction, dbs: dict[str, Any], db: str) -> Iterator[tuple[bytes, Any]]:
    with txn.cursor(db=dbs[db]) as cur:
        for k, v in cur:
            yield bytes(k), decode(db, v)


def _load_part(txn: lmdb.Transaction, dbs: dict[str, Any], data: bytes) -> None:
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        for item in unpacker:
            if not (isinstance(item, list) and len(item) == 2 and item[0] in dbs and item[0] not in _SKIP
                    and isinstance(item[1], list) and len(item[1]) % 2 == 0):
                raise CheckpointCorrupt("a checkpoint part holds a record batch of the wrong shape")
            flat = item[1]
            with txn.cursor(db=dbs[item[0]]) as cur:
                _, added = cur.putmulti(list(zip(flat[::2], flat[1::2], strict=True)), append=True)
            if added != len(flat) // 2:
                raise CheckpointCorrupt(f"a checkpoint part holds duplicate keys in {item[0]!r}")
    except (ValueError, TypeError, lmdb.Error, msgpack.UnpackException) as e:
        raise CheckpointCorrupt(f"a checkpoint part does not decode: {e!r}") from None


# -- maintenance ---------------------------------------------------------------------------


def collect_checkpoints(storage: Storage, *, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` checkpoints, and parts no manifest names that an
    attempt left behind (only below the newest checkpoint: a newer one may be in progress).
    Manifests go first, so a reader never picks a checkpoint whose parts are half gone."""
    keys = storage.list(CHECKPOINT_PREFIX)
    by_seq: dict[int, list[str]] = {}
    for k in keys:
        s = _seq_of(k)
        if s is not None:
            by_seq.setdefault(s, []).append(k)
    complete = sorted(s for s, ks in by_seq.items() if manifest_key(s) in ks)
    kept = set(complete[-keep:]) if keep > 0 else set()
    newest = complete[-1] if complete else -1
    removed: list[str] = []
    for s, ks in sorted(by_seq.items()):
        if s in kept:
            named = _named_parts(storage, s)
            doomed = [k for k in ks if k != manifest_key(s) and named is not None and k not in named]
        elif s < newest or s in complete:
            doomed = sorted(ks, key=lambda k: k != manifest_key(s))  # the manifest first
        else:
            doomed = []
        for k in doomed:
            storage.delete(k)
            removed.append(k)
    return removed


def _named_parts(storage: Storage, seq: int) -> set[str] | None:
    try:
        return {p["key"] for p in read_manifest(storage, seq, store_id=None)["parts"]}
    except CheckpointCorrupt:
        return None  # leave a damaged checkpoint's objects for fsck to report


def verify_checkpoints(storage: Storage, fold_to: Callable[[int], Index | None], *,
                       store_id: str | None) -> list[str]:
    """Problems of every checkpoint: hashes, counts, decoding, and agreement with the log.

    ``fold_to(seq)`` returns an index holding the fold of the log up to ``seq`` (or None when
    the log no longer reaches back that far); each checkpoint must equal it database by database.
    """
    import os
    import shutil
    import tempfile

    problems: list[str] = []
    for seq in list_checkpoints(storage):
        tmp = tempfile.mkdtemp(prefix="mint-ckpt-")
        idx = Index.acquire(os.path.join(tmp, "db"))
        try:
            load_checkpoint(storage, seq, idx, store_id=store_id)
            fold = fold_to(seq)
            if fold is not None:
                with idx.read() as a, fold.read() as b:
                    for db in sorted(a.dbs):
                        if db in _SKIP:
                            continue
                        if dict(a.scan(db)) != dict(b.scan(db)):
                            problems.append(f"checkpoint {seq}: database {db!r} disagrees with the log at {seq}")
        except CheckpointCorrupt as e:
            problems.append(str(e))
        finally:
            idx.release()
            shutil.rmtree(tmp, ignore_errors=True)
    return problems


# -- the writer's background checkpointer ----------------------------------------------------


class Checkpointer:
    """Writes a checkpoint every ``every`` commits or ``interval_s`` seconds (when anything
    was committed), off the writer thread, from a read snapshot; and one at a clean close."""

    def __init__(self, storage: Storage, index: Index, *, store_id: str | None, every: int,
                 interval_s: float, enabled: Callable[[], bool]) -> None:
        self.storage, self.index, self.store_id = storage, index, store_id
        self.every, self.interval_s, self.enabled = every, interval_s, enabled
        try:
            existing = list_checkpoints(storage)
        except Exception:  # never fail a writer's open for this: the first dump just comes sooner
            log.warning("could not list the index checkpoints of %s", storage.url, exc_info=True)
            existing = []
        self.covered = existing[-1] if existing else 0
        self._head = 0
        self._last_time = time.monotonic()
        self._mutex = threading.Lock()  # one dump at a time
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mint-checkpoint", daemon=True)
        self._thread.start()

    def on_commit(self, seq: int) -> None:
        """A commit listener (writer thread): cheap; wakes the dumper when one is due."""
        self._head = seq
        if seq - self.covered >= self.every:
            self._wake.set()

    def write_now(self) -> int:
        with self._mutex:
            seq = write_checkpoint(self.storage, self.index, store_id=self.store_id)
            self.covered = max(self.covered, seq)
            self._last_time = time.monotonic()
            log.info("checkpoint of the index at seq %d written", seq)
            return seq

    def _due(self) -> bool:
        behind = self._head - self.covered
        return behind >= self.every or (behind > 0 and time.monotonic() - self._last_time >= self.interval_s)

    def _run(self) -> None:
        while True:
            self._wake.wait(timeout=min(self.interval_s, 5.0))
            self._wake.clear()
            if self._stop:
                return
            if self._due() and self.enabled():
                try:
                    self.write_now()
                except Exception:  # a storage hiccup: the next trigger tries again
                    log.warning("writing an index checkpoint failed; retrying later", exc_info=True)

    def close(self, *, final: bool) -> None:
        """Stop; with ``final``, checkpoint what the last one does not cover -- when that is a
        tenth of ``every`` commits or more: a one-publish CLI session on a big store must not
        dump the whole index at exit (a short tail is cheap to replay)."""
        self._stop = True
        self._wake.set()
        self._thread.join()
        if final and self.enabled():
            with self.index.read() as t:
                behind = t.last_seq - self.covered >= max(1, self.every // 10)
            if behind:
                try:
                    self.write_now()
                except Exception:
                    log.warning("the checkpoint at close failed; the next writer writes one", exc_info=True)



def checkpoint_problems(storage: Storage, *, store_id: str | None) -> list[str]:
    """``fsck``'s check: every checkpoint loads, and equals the fold of the log at its seq."""
    import os
    import shutil
    import tempfile

    from .commit_log import CommitLog, apply_event

    commit_log = CommitLog(storage)
    tmp = tempfile.mkdtemp(prefix="mint-fold-")
    fold = Index.acquire(os.path.join(tmp, "db"))
    state = {"seq": 0, "broken": False}

    def fold_to(seq: int) -> Index | None:
        while not state["broken"] and state["seq"] < seq:
            event = commit_log.read(state["seq"] + 1)
            if event is None:  # the log was compacted: checkpoints past this are checked alone
                state["broken"] = True
                break
            with fold.write() as w:
                apply_event(w, event)
            state["seq"] += 1
        return None if state["broken"] else fold

    try:
        return verify_checkpoints(storage, fold_to, store_id=store_id)
    finally:
        fold.release()
        shutil.rmtree(tmp, ignore_errors=True)
