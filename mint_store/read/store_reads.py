"""The store's read path: resolve refs, read rows, load adapters, list what the index holds.

Half of :class:`~mint_store.store.Store`. Reads never touch the writer: one LMDB read
transaction to resolve, one read call for the bytes, one hash to verify.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..errors import (
    AdapterNotFound,
    BaseNotFound,
    BlobNotFound,
    IntegrityError,
    LayoutNotFound,
    MintError,
    StaleLocation,
)
from ..format.adapter import Adapter
from ..format.layout import Layout
from ..format.names import Ref, check_name, parse_ref, parse_ref_cached
from ..format.packs import read_row_with_zarr
from ..index.lmdb_index import Index, Txn, seq_key, version_key
from ..index.queries import owned_by, resolve_in, stores_layout, version_record
from ..results import Location, VersionInfo
from ..storage import Storage
from .buffers import empty_row
from .verified import read_verified


class StoreReads:
    """The read half of :class:`~mint_store.store.Store` (thread-safe, no writer needed)."""

    storage: Storage
    _zstore: Any

    def _idx(self) -> Index:
        raise NotImplementedError

    @contextmanager
    def index_snapshot(self) -> Iterator[Txn]:
        """One read transaction of the index: a consistent snapshot of names, versions, shards
        and blobs, for what reads records the read API does not return (fsck, compaction, stats,
        the catalog, a shard's block digests).

        Writes committed while the block runs are not seen. Use it on the thread that opened it
        (an LMDB read transaction belongs to its thread), and keep it short: a long one holds
        pages the writer cannot reuse until it ends.
        """
        with self._idx().read() as t:
            yield t

    def index_bytes(self) -> int:
        """The index's size on disk in bytes (its used pages)."""
        return self._idx().nbytes()

    def resolve(self, ref: str | Ref) -> Location:
        """Where the row a ref names lives, in one read transaction (the hot path).

        Parameters
        ----------
        ref
            ``tenant/name`` (latest), ``tenant/name@7``, ``tenant/name:prod`` or ``sha:<content_id>``.

        Returns
        -------
        Location
            Content id, layout, shard key, offset and length: enough for :meth:`read_row`.

        Raises
        ------
        InvalidName
            A malformed ref.
        NotFound
            No such adapter, version, tag or content id (``AdapterNotFound``, ``VersionNotFound``, ...).
        VersionDeleted
            The version was deleted.
        DamagedAdapter
            Its row was quarantined by ``fsck``.
        """
        r = parse_ref_cached(ref) if isinstance(ref, str) else ref
        index = self._idx()
        txn = index.env.begin()
        try:
            return resolve_in(Txn(txn, index.dbs), r)
        finally:
            txn.abort()

    def resolve_many(
        self, refs: Sequence[str | Ref], *, owners: Collection[str] | None = None
    ) -> list[Location | MintError]:
        """Many refs in one read transaction; a failed ref yields its error in place.

        With ``owners``, a ``sha:`` ref resolves only when a live version of one of those
        tenants holds it (BlobNotFound otherwise): the service's tenant isolation.
        """
        out: list[Location | MintError] = []
        index = self._idx()
        txn = index.env.begin()  # as in resolve: an engine's switch runs through here
        try:
            t = Txn(txn, index.dbs)
            for ref in refs:
                try:
                    r = parse_ref_cached(ref) if isinstance(ref, str) else parse_ref(ref)
                    if owners is not None and r.content_id is not None and not owned_by(t, r.content_id, owners):
                        raise BlobNotFound(f"no live adapter with content id {r.content_id}")
                    out.append(resolve_in(t, r))
                except MintError as e:
                    out.append(e)
        finally:
            txn.abort()
        return out

    def read_row(self, loc: Location, out: Any = None, *, verify: bool = True) -> Any:
        """Read one row in one pass (:func:`~mint_store.read.verified.read_verified`), verified against its content id.

        Parameters
        ----------
        loc
            From :meth:`resolve`.
        out
            A writable buffer of at least ``loc.length`` bytes; a new uint8 array when None.
        verify
            Hash the bytes and compare them with ``loc.content_id``.

        Returns
        -------
        Any
            ``out`` (or the new array), its first ``loc.length`` bytes filled.

        Raises
        ------
        ValueError
            ``out`` is smaller than the row, or read-only.
        StaleLocation
            The shard is gone (compacted and swept): resolve again (:meth:`read` does).
        IntegrityError
            The bytes do not match the content id; run ``mint fsck``.
        """
        if out is None:
            out = empty_row(loc.length)
        try:
            read_verified(self.storage, loc, out, verify=verify)
        except BlobNotFound:
            raise StaleLocation(f"shard {loc.shard_key} is gone (compacted); resolve again") from None
        return out

    def read(self, ref: str | Ref, out: Any = None) -> tuple[Location, Any]:
        """Resolve and read, re-resolving once if the location went stale."""
        loc = self.resolve(ref)
        try:
            return loc, self.read_row(loc, out)
        except StaleLocation:
            loc = self.resolve(ref)
            return loc, self.read_row(loc, out)

    def read_row_zarr(self, loc: Location) -> np.ndarray:
        """The same row through Zarr's own read path (for cross-checks)."""
        if self._zstore is None:
            self._zstore = self.storage.zarr_store()
        return read_row_with_zarr(self._zstore, loc.layout_id, loc.row)

    def load(self, ref: str | Ref) -> Adapter:
        """The adapter a ref names; its tensors are views of one freshly read, verified row.

        Parameters
        ----------
        ref
            As for :meth:`resolve`.

        Returns
        -------
        Adapter
            With its PEFT config when named by tenant/name (a ``sha:`` ref has none).

        Raises
        ------
        NotFound, VersionDeleted, DamagedAdapter
            As :meth:`resolve`.
        IntegrityError
            The stored bytes do not match their content id.
        """
        r = parse_ref(ref)
        config = None
        if r.content_id is None:  # resolved once: the row and the config of one version, a tag moved meanwhile
            info = self.version(r)
            r, config = parse_ref(info.ref), info.peft_config
        loc, row = self.read(r)
        return Adapter.from_row(self.layout(loc.layout_id), row, peft_config=config)

    def layout(self, layout_id: str, *, owners: Collection[str] | None = None) -> Layout:
        """The layout table ``layout_id``; with ``owners``, LayoutNotFound unless a live version of
        one of those tenants has rows of it (the service's tenant isolation, as for ``sha:`` refs)."""
        with self._idx().read() as t:
            rec = t.get("layouts", layout_id.encode())
            if rec is not None and owners is not None and not stores_layout(t, layout_id, owners):
                rec = None
        if rec is None:
            raise LayoutNotFound(f"no layout {layout_id}")
        layout = Layout.from_dict(rec["layout"])
        if layout.layout_id != layout_id:  # the id is the table's hash: a damaged index lies
            raise IntegrityError(f"layout {layout_id}: the index holds a table that hashes to {layout.layout_id}; "
                                 "run `mint fsck` (and `mint reindex` to rebuild the index from the log)")
        return layout

    def base(self, base: str) -> dict[str, list[int]]:
        with self._idx().read() as t:
            rec = t.get("bases", check_name(base, "base").encode())
        if rec is None:
            raise BaseNotFound(f"no base {base!r} registered")
        return dict(rec)

    def bases(self) -> dict[str, int]:
        """Every registered base, by name, with its number of modules."""
        with self._idx().read() as t:
            return {k.decode(): len(v) for k, v in t.scan("bases")}

    def _info(self, t: Txn, rec: dict[str, Any], tags: dict[int, tuple[str, ...]] | None = None) -> VersionInfo:
        """``rec`` with its tags (``tags``: the name's tags by version, when the caller has them)."""
        by_version = self._tags_by_version(t, rec["tenant"], rec["name"]) if tags is None else tags
        return VersionInfo.from_dict(rec, by_version.get(rec["version"], ()))

    @staticmethod
    def _tags_by_version(t: Txn, tenant: str, name: str) -> dict[int, tuple[str, ...]]:
        """Every tag of a name, by the version it names: one scan of its tags."""
        out: dict[int, tuple[str, ...]] = {}
        for k, v in t.scan("tags", f"{tenant}/{name}:".encode()):
            out[v["version"]] = (*out.get(v["version"], ()), k.decode().rsplit(":", 1)[1])
        return out

    def version(self, ref: str | Ref) -> VersionInfo:
        """Metadata of the version a ref names (deleted versions included when named by number)."""
        r = parse_ref(ref)
        with self._idx().read() as t:
            return self._info(t, version_record(t, r))

    def versions(self, tenant: str, name: str, *, after: int = 0, limit: int | None = None) -> list[VersionInfo]:
        """Versions of ``tenant/name`` in order (deleted ones flagged): those above ``after``, at
        most ``limit`` of them (all without). :class:`AdapterNotFound` for a name never published."""
        check_name(tenant, "tenant")
        check_name(name)
        if after < 0 or (limit is not None and limit < 1):
            raise ValueError(f"after must be >= 0 and limit >= 1, got after={after}, limit={limit}")
        with self._idx().read() as t:
            if t.get("names", f"{tenant}/{name}".encode()) is None:
                raise AdapterNotFound(f"no adapter {tenant}/{name}")
            tags = self._tags_by_version(t, tenant, name)  # once, not once per version
            out: list[VersionInfo] = []
            prefix = f"{tenant}/{name}@".encode()
            for _, rec in t.scan("versions", prefix, version_key(tenant, name, after + 1) if after else None):
                out.append(self._info(t, rec, tags))
                if limit is not None and len(out) >= limit:
                    break
            return out

    def names(self, tenant: str, *, prefix: str = "", after: str | None = None, limit: int = 1000) -> list[str]:
        """Adapter names of a tenant in order, ``prefix``-filtered, starting after ``after``."""
        check_name(tenant, "tenant")
        start = f"{tenant}/{after}\x00".encode() if after else None
        out: list[str] = []
        with self._idx().read() as t:
            for k, _ in t.scan("names", f"{tenant}/{prefix}".encode(), start):
                out.append(k.decode().split("/", 1)[1])
                if len(out) >= limit:
                    break
        return out

    def tenants(self) -> list[str]:
        out: list[str] = []
        with self._idx().read() as t:
            start: bytes | None = None
            while True:
                it = t.scan("names", b"", start)
                first = next(it, None)
                if first is None:
                    return out
                tenant = first[0].decode().split("/", 1)[0]
                out.append(tenant)
                start = (tenant + "0").encode()  # '0' sorts right after '/'

    @property
    def last_seq(self) -> int:
        with self._idx().read() as t:
            return t.last_seq

    def events(self, after: int = 0, *, limit: int = 1000) -> list[dict[str, Any]]:
        with self._idx().read() as t:
            return [v for _, v in itertools.islice(t.scan("events", b"", seq_key(after + 1)), limit)]

    def index_stats(self) -> dict[str, int]:
        """Entries per index database, the index's bytes on disk and the last seq."""
        idx = self._idx()
        with idx.read() as t:
            out = {db: t.count(db) for db in ("names", "versions", "tags", "blobs", "layouts", "shards", "events")}
            out["last_seq"] = t.last_seq
        out["index_bytes"] = idx.nbytes()
        return out

    def iter_versions(self) -> Iterator[VersionInfo]:
        with self._idx().read() as t:
            name, tags = None, {}
            for _, rec in t.scan("versions"):  # (in key order: a name's versions come together)
                if (rec["tenant"], rec["name"]) != name:
                    name = (rec["tenant"], rec["name"])
                    tags = self._tags_by_version(t, *name)
                yield self._info(t, rec, tags)
