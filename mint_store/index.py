"""The LMDB index: a materialised view of the commit log, for microsecond lookups.

Named databases (keys are ASCII; values are pickled plain dicts/ints -- the index is a
private, local, materialised view that ``reindex`` rebuilds from the JSON log, so it never
holds anything a stranger wrote; pickle decodes 3-4x faster than JSON, which is most of
a resolve):

    names     tenant/name               -> {"next": int, "latest": int | null}
    versions  tenant/name@<u64 BE>      -> version record
    tags      tenant/name:tag           -> version (int)
    blobs     content_id                -> {"layout", "row", "shard", "offset", "length", "refs", "state"}
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
import pickle
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

INDEX_FORMAT = 2
_DBS = ("names", "versions", "tags", "blobs", "layouts", "shards", "events", "bases", "meta", "owners")
_U64 = struct.Struct(">Q")


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def loads(b: bytes | memoryview | None) -> Any:
    return None if b is None else pickle.loads(b)


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
        return loads(self.txn.get(key, db=self.dbs[db]))

    def put(self, db: str, key: bytes, value: Any) -> None:
        self.txn.put(key, dumps(value), db=self.dbs[db])

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
                yield key, loads(v)

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
                yield k, loads(cur.value())
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
        self.dbs = {name: self.env.open_db(name.encode(), create=not readonly) for name in _DBS}
        if not readonly:
            self._check_format()

    def _check_format(self) -> None:
        with self.write() as t:
            fmt = t.get("meta", b"format")
            if fmt is None:
                t.put("meta", b"format", INDEX_FORMAT)
            elif fmt != INDEX_FORMAT:
                raise RuntimeError(f"index {self.path} has format {fmt}; this build reads {INDEX_FORMAT}")

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
