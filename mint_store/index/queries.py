"""Read-side lookups inside one LMDB transaction (shared by the reader and the writer)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..errors import (
    AdapterNotFound,
    BlobNotFound,
    DamagedAdapter,
    TagNotFound,
    VersionDeleted,
    VersionNotFound,
)
from ..format.names import Ref
from ..results import Location, make_location
from .lmdb_index import ROWS, Txn, version_key


def version_record(t: Txn, r: Ref) -> dict[str, Any]:
    if r.tenant is None or r.name is None:
        raise AdapterNotFound(f"{r} does not name a version")
    version = r.version
    if version is None:
        if r.tag is not None:
            tagged = t.get("tags", f"{r.tenant}/{r.name}:{r.tag}".encode())
            if tagged is None:
                raise TagNotFound(f"no tag {r.tag!r} on {r.tenant}/{r.name}")
            version = tagged["version"]
        else:
            rec = t.get("names", f"{r.tenant}/{r.name}".encode())
            if rec is None:
                raise AdapterNotFound(f"no adapter {r.tenant}/{r.name}")
            if rec["latest"] is None:
                raise VersionDeleted(f"every version of {r.tenant}/{r.name} is deleted")
            version = rec["latest"]
    info = t.get("versions", version_key(r.tenant, r.name, version))
    if info is None:
        if t.get("names", f"{r.tenant}/{r.name}".encode()) is None:
            raise AdapterNotFound(f"no adapter {r.tenant}/{r.name}")
        raise VersionNotFound(f"no version {version} of {r.tenant}/{r.name}")
    return dict(info)

# field positions of the fixed-position records (index.ROWS) that a resolve reads
_LATEST_CID = ROWS["names"].index("latest_cid")
_TAG_CID = ROWS["tags"].index("content_id")
_LAYOUT, _ROW, _SHARD, _OFFSET, _LENGTH, _REFS, _STATE = (
    ROWS["blobs"].index(f) for f in ("layout_id", "row", "shard", "offset", "length", "refs", "state"))


def resolve_in(t: Txn, r: Ref) -> Location:
    """Two gets for every ref form: names and tags carry the content id they point at."""
    cid: str | None = r.content_id
    if cid is not None:
        blob = t.row("blobs", cid.encode())
        if blob is None or blob[_REFS] <= 0:
            raise BlobNotFound(f"no live adapter with content id {cid}")
    else:
        if r.version is None and r.tag is None:
            rec = t.row("names", f"{r.tenant}/{r.name}".encode())
            cid = rec[_LATEST_CID] if rec is not None else None
        elif r.tag is not None:
            tagged = t.row("tags", f"{r.tenant}/{r.name}:{r.tag}".encode())
            cid = tagged[_TAG_CID] if tagged is not None else None
        if cid is None:  # a version number, or an error to explain: the full lookup
            info = version_record(t, r)
            if info["deleted"]:
                raise VersionDeleted(f"{r.tenant}/{r.name}@{info['version']} is deleted")
            cid = info["content_id"]
        blob = t.row("blobs", cid.encode())
        if blob is None:
            raise BlobNotFound(f"no adapter row for content id {cid}; run `mint fsck`")
    if blob[_STATE] != "ok":
        raise DamagedAdapter(f"{r} (content id {cid}) is quarantined as damaged; republish it")
    return make_location(cid, blob[_LAYOUT], blob[_SHARD], blob[_OFFSET], blob[_LENGTH], blob[_ROW])


def blob_location(content_id: str, blob: dict[str, Any]) -> Location:
    """Where a ``blobs`` record (as ``Txn.get`` hands it out) places the row of ``content_id``."""
    return make_location(content_id, blob["layout_id"], blob["shard"], blob["offset"], blob["length"],
                         blob.get("row", 0))


def owned_by(t: Txn, content_id: str, tenants: Iterable[str]) -> bool:
    """True when a live version of one of ``tenants`` holds the blob."""
    return any(t.get("owners", f"{content_id}/{tenant}".encode()) for tenant in tenants)


def stores_layout(t: Txn, layout_id: str, tenants: Iterable[str]) -> bool:
    """True when a live version of one of ``tenants`` has rows of ``layout_id``. The names'
    latest versions first (one blob get each: the usual hit), then all their versions."""
    for tenant in tenants:
        prefix = f"{tenant}/".encode()
        for _, rec in t.scan("names", prefix):
            cid = rec.get("latest_cid")
            blob = t.row("blobs", cid.encode()) if cid else None
            if blob is not None and blob[_LAYOUT] == layout_id and owned_by(t, cid, (tenant,)):
                return True
        if any(not v["deleted"] and v["layout_id"] == layout_id for _, v in t.scan("versions", prefix)):
            return True
    return False

