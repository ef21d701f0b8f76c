"""The LMDB index: a materialised view of the commit log, for microsecond lookups.

Named databases (keys are ASCII; values are msgpack: maps, except the fixed-position
arrays of ``ROWS`` that a resolve reads). Never pickle: whoever can write the index
directory must not get to run code in every reader. An index written by an older build
(format 2, pickled values) is detected by its ``meta/format`` bytes alone, never decoded,
and rebuilt from the commit log at a writable open (see ``IndexFormatMismatch``).

    names     tenant/name               -> [next, latest | null, latest_cid | null]
    versions  tenant/name@<u64 BE>      -> version record
    tags      tenant/name:tag           -> [version, content_id]
    blobs     content_id                -> [layout_id, row, shard, offset, length, refs, state]
    layouts   layout_id                 -> {"layout": table, "rows_per_shard", "chunk_cols", "next_row"}
    shards    shard key                 -> {"layout", "live", "total"}
    events    <u64 BE seq>              -> event summary (the change feed)
    bases     base                      -> {module: [in, out(, experts)]}
    owners    content_id/tenant         -> live versions of that tenant holding the blob
    meta      b"last_seq", b"format"

One environment per directory per process (LMDB forbids opening it twice); a process
that forked gets its own environment on first use instead of the parent's. A reader
whose process may write the directory opens the environment write-capable (and never
writes), so that a later writer in the same process (a client's first publish) shares it.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import msgpack

from ..errors import IndexFormatMismatch

# 3: msgpack values (2 was pickle)
INDEX_FORMAT = 3
_DBS = ("names", "versions", "tags", "blobs", "layouts", "shards", "events", "bases", "meta", "owners")
_U64 = struct.Struct(">Q")


# ext type for integers msgpack cannot hold (beyond 64 bits): a peft_config may carry one,
# and a value the index cannot encode would stop every replay of that commit
_BIGINT = 1
# surrogatepass: a JSON string may hold a lone surrogate; the index keeps the exact str
_packb = msgpack.Packer(use_bin_type=True, unicode_errors="surrogatepass").pack


def _unpack_ext(code: int, data: bytes) -> Any:
    if code == _BIGINT:
        return int(data.decode("ascii"))
    raise ValueError(f"unknown msgpack ext type {code} in the index")


def _big_ints(obj: Any) -> Any:
    if isinstance(obj, bool) or obj is None:
        return obj
    if isinstance(obj, int):
        return obj if -(2**63) <= obj < 2**64 else msgpack.ExtType(_BIGINT, str(obj).encode("ascii"))
    if isinstance(obj, dict):
        return {k: _big_ints(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_big_ints(v) for v in obj]
    return obj


def dumps(obj: Any) -> bytes:
    """One index value as msgpack (tuples come back as lists; str keys only)."""
    try:
        return _packb(obj)
    except OverflowError:  # rare: walk the value once more, boxing the big integers
        return _packb(_big_ints(obj))


def loads(b: bytes | memoryview | None) -> Any:
    if b is None:
        return None
    return msgpack.unpackb(b, unicode_errors="surrogatepass", ext_hook=_unpack_ext)


# The records a resolve reads are fixed-position msgpack arrays: no key strings to decode,
# about 3x faster than a map (or than the pickle of a dict). Their values are ASCII (names,
# hex ids, shard keys) and small ints, so the hot path decodes them with no options at all.
# Every other record is a map. Txn.get/put/scan hand out and take dicts for all of them.
ROWS: dict[str, tuple[str, ...]] = {
    "names": ("next", "latest", "latest_cid"),
    "tags": ("version", "content_id"),
    "blobs": ("layout_id", "row", "shard", "offset", "length", "refs", "state"),
}
_unpack_row = msgpack.unpackb


def encode(db: str, value: Any) -> bytes:
    fields = ROWS.get(db)
    if fields is not None and isinstance(value, dict) and len(value) == len(fields):
        try:
            return dumps([value[f] for f in fields])
        except KeyError:
            pass
    return dumps(value)  # another shape (none today): a map, still read back right


def decode(db: str, raw: bytes | memoryview | None) -> Any:
    obj = loads(raw)
    fields = ROWS.get(db)
    if fields is not None and type(obj) is list:
        return dict(zip(fields, obj, strict=True))
    return obj


def version_key(tenant: str, name: str, version: int) -> bytes:
    return f"{tenant}/{name}@".encode() + _U64.pack(version)


def seq_key(seq: int) -> bytes:
    return _U64.pack(seq)


class Txn:
    """A transaction with typed accessors. Never share one across threads."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict[str, Any]) -> None:
        self.txn = txn
        self.dbs = dbs

    def get(self, db: str, key: bytes) -> Any:
        return decode(db, self.txn.get(key, db=self.dbs[db]))

    def row(self, db: str, key: bytes) -> list[Any] | None:
        """The hot path: a record of ``ROWS[db]`` as its list of fields, in ROWS order."""
        raw = self.txn.get(key, db=self.dbs[db])
        if raw is None:
            return None
        obj = _unpack_row(raw)
        return obj if type(obj) is list else [obj[f] for f in ROWS[db]]

    def put(self, db: str, key: bytes, value: Any) -> None:
        self.txn.put(key, encode(db, value), db=self.dbs[db])

    def delete(self, db: str, key: bytes) -> None:
        self.txn.delete(key, db=self.dbs[db])

    def scan(self, db: str, prefix: bytes = b"", start: bytes | None = None) -> Iterator[tuple[bytes, Any]]:
        """Keys with ``prefix`` in order, from ``start`` (inclusive) if given."""
        with self.txn.cursor(db=self.dbs[db]) as cur:
            if not cur.set_range(max(prefix, start or b"")):
                return
            for k, v in cur:
                key = bytes(k)
                if not key.startswith(prefix):
                    return
                yield key, decode(db, v)

    def scan_back(self, db: str, prefix: bytes) -> Iterator[tuple[bytes, Any]]:
        """Keys with ``prefix`` in reverse order."""
        with self.txn.cursor(db=self.dbs[db]) as cur:
            end = prefix[:-1] + bytes([prefix[-1] + 1]) if prefix else None
            if end is None or not cur.set_range(end):
                if not cur.last():
                    return
            elif not cur.prev():
                return
            while True:
                k = bytes(cur.key())
                if not k.startswith(prefix):
                    return
                yield k, decode(db, cur.value())
                if not cur.prev():
                    return

    def count(self, db: str) -> int:
        return int(self.txn.stat(self.dbs[db])["entries"])

    @property
    def last_seq(self) -> int:
        return int(self.get("meta", b"last_seq") or 0)


_OPEN: dict[tuple[int, str], Index] = {}
_OPEN_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """Drop the parent's environments in a forked child.

    LMDB must not be used after fork, and py-lmdb refuses a second open of a path it
    believes open; its ``close`` in the child releases our handle without touching the
    parent's reader slots or locks, after which the child opens its own environment.
    """
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()  # another thread may have held it at fork time
    for idx in list(_OPEN.values()):
        try:
            idx.env.close()
        except lmdb.Error:
            pass
    _OPEN.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Index:
    """An LMDB environment with its named databases."""

    def __init__(self, path: Path, *, map_size: int, readonly: bool) -> None:
        self.path = path
        self.readonly = readonly
        self.pid = os.getpid()
        self._refs = 0
        kwargs: dict[str, Any] = dict(
            map_size=map_size, max_dbs=len(_DBS) + 2, subdir=True, readahead=False, max_readers=1024
        )
        # write-capable unless we may not write here: a reader can become the writer later
        self.can_write = not readonly or (os.access(path, os.W_OK) and os.access(path / "data.mdb", os.W_OK))
        if not self.can_write:
            self.env = lmdb.open(str(path), readonly=True, lock=True, **kwargs)
        else:
            path.mkdir(parents=True, exist_ok=True)
            self.env = lmdb.open(str(path), sync=True, metasync=True, create=not readonly, **kwargs)
        try:
            self.dbs = {name: self.env.open_db(name.encode(), create=not readonly) for name in _DBS}
            self._check_format()
        except BaseException:
            self.env.close()
            raise

    def _check_format(self) -> None:
        """Refuse (IndexFormatMismatch) an index of another format, by its raw bytes only."""
        with self.env.begin(write=not self.readonly) as txn:
            raw = txn.get(b"format", db=self.dbs["meta"])
            if raw is None and not txn.stat(self.dbs["meta"])["entries"]:
                if not self.readonly:
                    txn.put(b"format", dumps(INDEX_FORMAT), db=self.dbs["meta"])  # a new index
                return
            if raw is not None and bytes(raw) == dumps(INDEX_FORMAT):
                return
        # the bytes of format 2 are a pickle: say what they are, never load them
        found = "2 (pickled records)" if raw is not None and bytes(raw)[:1] == b"\x80" else repr(
            bytes(raw or b"")[:16])
        raise IndexFormatMismatch(
            f"index {self.path} has format {found}; this build reads format {INDEX_FORMAT}. Open the store "
            "writable once (it rebuilds the index from the commit log) or run `mint reindex`"
        )

    @classmethod
    def acquire(cls, path: str | os.PathLike[str], *, map_size: int = 2**40, readonly: bool = False) -> Index:
        """The process-wide environment for ``path`` (opened once, shared, refcounted)."""
        real = os.path.realpath(path)
        key = (os.getpid(), real)
        with _OPEN_LOCK:
            idx = _OPEN.get(key)
            if idx is not None and idx.readonly and not readonly:
                if not idx.can_write:
                    raise RuntimeError(
                        f"index {real} is already open read-only in this process (no write permission); "
                        "close it before opening it for writing"
                    )
                idx._check_format()
                idx.readonly = False
            if idx is None:
                if readonly and not (Path(real) / "data.mdb").exists():
                    raise FileNotFoundError(f"no index at {real}")
                idx = cls(Path(real), map_size=map_size, readonly=readonly)
                _OPEN[key] = idx
            idx._refs += 1
            return idx

    def release(self) -> None:
        with _OPEN_LOCK:
            self._refs -= 1
            if self._refs <= 0:
                _OPEN.pop((os.getpid(), str(self.path)), None)
                self.env.close()

    @contextmanager
    def read(self) -> Iterator[Txn]:
        with self.env.begin(buffers=False) as txn:
            yield Txn(txn, self.dbs)

    @contextmanager
    def write(self) -> Iterator[Txn]:
        with self.env.begin(write=True) as txn:
            yield Txn(txn, self.dbs)

    def nbytes(self) -> int:
        info = self.env.info()
        stat = self.env.stat()
        return int((info["last_pgno"] + 1) * stat["psize"])


def index_db_path(index_dir: str | os.PathLike[str]) -> str:
    """The LMDB environment lives in ``<index_dir>/db``; ``reindex`` swaps that folder."""
    return os.path.join(index_dir, "db")


def finish_swap(index_dir: str | os.PathLike[str]) -> None:
    """Complete a ``reindex`` swap that a crash interrupted (run under the writer lock).

    The swap is ``db -> db.old``, ``db.new -> db``, then ``db.old`` removed: whichever
    step was last done, this brings the folder to the state after the swap.
    """
    import shutil

    db, new, old = (os.path.join(index_dir, n) for n in ("db", "db.new", "db.old"))
    if not os.path.exists(db) and os.path.exists(new):
        os.rename(new, db)
    elif os.path.exists(new) and os.path.exists(db):
        shutil.rmtree(new)  # an unfinished rebuild: the old index is still the truth
    if os.path.exists(old):
        shutil.rmtree(old)
