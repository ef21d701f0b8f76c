"""The commit log: one immutable object per commit, and the state machine that applies it.

``log/<seq>.json`` is written after the shards it names and before the index commit,
create-only: if the object exists (another writer committed that seq) the commit fails
and nothing is overwritten. Events carry the writer's lease ``epoch`` (older logs lack
it; readers ignore it). The same :func:`apply_event` runs for a live commit, for replay
at open and for ``reindex``, so the index is always exactly the fold of the log.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import BlobNotFound, CommitConflict, IntegrityError, ObjectExists
from ..format.keys import check_event_keys
from ..storage import Storage
from .lmdb_index import Txn, seq_key, version_key

LOG_PREFIX = "log/"


def log_key(seq: int) -> str:
    return f"{LOG_PREFIX}{seq:020d}.json"


_SEQ_DIGITS = 20
_KEY_LEN = len(LOG_PREFIX) + _SEQ_DIGITS + len(".json")


def seq_of_key(key: str) -> int | None:
    """The seq ``key`` names under the writer's grammar (``log/`` + 20 ASCII digits + ``.json``,
    seq >= 1, as :func:`log_key` writes it), else None: anything else in ``log/`` (a backup
    copy, an editor's file, a nested key) is a foreign object that readers skip and count."""
    if len(key) != _KEY_LEN or not key.startswith(LOG_PREFIX) or not key.endswith(".json"):
        return None
    digits = key[len(LOG_PREFIX):len(LOG_PREFIX) + _SEQ_DIGITS]
    if not (digits.isascii() and digits.isdigit()):
        return None
    seq = int(digits)
    return seq if seq >= 1 else None


def is_temp_key(key: str) -> bool:
    """A local store's write in progress (``log/.<name>.<uuid>.tmp``): neither a commit nor foreign."""
    return key.startswith(LOG_PREFIX + ".") and key.endswith(".tmp") and "/" not in key[len(LOG_PREFIX):]


class CommitLog:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def write(self, event: dict[str, Any]) -> None:
        key = log_key(int(event["seq"]))
        try:
            self.storage.create(key, json.dumps(event, separators=(",", ":")).encode())
        except ObjectExists:
            raise CommitConflict(
                f"{key} already exists: another writer committed seq {event['seq']} (two writers on one "
                "store); this commit was not applied. Reopen the store to replay the log"
            ) from None

    def read(self, seq: int) -> dict[str, Any] | None:
        try:
            raw = self.storage.get(log_key(seq))
        except BlobNotFound:
            return None
        try:
            event = json.loads(raw)
        except ValueError as e:
            raise IntegrityError(f"log object {log_key(seq)} is not valid JSON: {e}") from None
        if not isinstance(event, dict) or event.get("seq") != seq:
            raise IntegrityError(f"log object {log_key(seq)} does not hold event {seq}")
        return event

    def after(self, seq: int) -> list[dict[str, Any]]:
        """Events after ``seq``, probing one key at a time (no listing of a long log)."""
        out = []
        while (event := self.read(seq + 1)) is not None:
            out.append(event)
            seq += 1
        return out

    def all_seqs(self) -> list[int]:
        """Seqs of every log object (one listing); foreign objects in ``log/`` are skipped."""
        return [s for k in self.storage.list(LOG_PREFIX) if (s := seq_of_key(k)) is not None]


def summarize(event: dict[str, Any]) -> dict[str, Any]:
    """The change-feed entry of an event (what engines need to follow tags and caches)."""
    kind = event["kind"]
    out: dict[str, Any] = {"seq": event["seq"], "kind": kind, "time": event["time"]}
    if kind == "publish":
        out["items"] = [
            {"tenant": v[0], "name": v[1], "version": v[2], "content_id": v[3], "tag": v[4]}
            for v in event["versions"]
        ]
    elif kind in ("tag", "untag", "delete"):
        out.update({k: event.get(k) for k in ("tenant", "name", "version", "tag")})
    elif kind == "base":
        out["base"] = event["base"]
    elif kind == "compact":
        out.update(layout_id=event["layout_id"], content_ids=[m[0] for m in event["moves"]],
                   retired=event["retired"])
    elif kind == "sweep":
        out["shards"] = event["shards"]
    elif kind == "quarantine":
        out["content_ids"] = event["content_ids"]
    return out


def _change_refs(t: Txn, content_id: str, delta: int) -> None:
    blob = t.get("blobs", content_id.encode())
    before = blob["refs"]
    blob["refs"] = before + delta
    t.put("blobs", content_id.encode(), blob)
    if (before > 0) != (blob["refs"] > 0):
        shard = t.get("shards", blob["shard"].encode())
        shard["live"] += 1 if blob["refs"] > 0 else -1
        t.put("shards", blob["shard"].encode(), shard)


def _change_owner(t: Txn, content_id: str, tenant: str, delta: int) -> None:
    # which tenants hold a blob: lets the service serve sha: refs to their owners only
    key = f"{content_id}/{tenant}".encode()
    n = int(t.get("owners", key) or 0) + delta
    if n > 0:
        t.put("owners", key, n)
    else:
        t.delete("owners", key)


def _latest(t: Txn, tenant: str, name: str) -> tuple[int | None, str | None]:
    for _, rec in t.scan_back("versions", f"{tenant}/{name}@".encode()):
        if not rec["deleted"]:
            return int(rec["version"]), rec["content_id"]
    return None, None


def _apply_publish(t: Txn, event: dict[str, Any]) -> None:
    layouts: dict[str, dict[str, Any]] = {}
    shards: dict[str, dict[str, Any]] = {}

    def layout(layout_id: str) -> dict[str, Any]:
        if layout_id not in layouts:
            layouts[layout_id] = t.get("layouts", layout_id.encode())
        return layouts[layout_id]

    def shard(key: str, layout_id: str) -> dict[str, Any]:
        if key not in shards:
            shards[key] = t.get("shards", key.encode()) or {"layout_id": layout_id, "live": 0, "total": 0}
        return shards[key]

    for lay in event["layouts"]:
        if layout(lay["layout_id"]) is None:
            layouts[lay["layout_id"]] = {**lay, "next_row": 0}
    blobs: dict[str, dict[str, Any]] = {}
    for group in event["rows"]:
        layout_id, length = group["layout_id"], group["length"]
        lay = layout(layout_id)
        for sh in group["shards"]:
            rec = shard(sh["key"], layout_id)
            if "blocks" in sh:  # the anchor of the shard's block table (mint_store.format.blocks)
                rec["blocks"] = sh["blocks"]
            for cid, row, offset in sh["rows"]:
                # a row rewritten over a damaged or lost one keeps the references it had
                old = blobs.get(cid) or t.get("blobs", cid.encode())
                refs = old["refs"] if old else 0
                if old:
                    prev = shard(old["shard"], layout_id)
                    prev["total"] -= 1
                    prev["live"] -= 1 if refs > 0 else 0
                blobs[cid] = {"layout_id": layout_id, "row": row, "shard": sh["key"], "offset": offset,
                              "length": length, "refs": refs, "state": "ok"}
                rec["total"] += 1
                rec["live"] += 1 if refs > 0 else 0
                lay["next_row"] = max(lay["next_row"], row + 1)
    names: dict[str, dict[str, Any]] = {}
    owners: dict[str, int] = {}  # content_id/tenant -> new versions (see _change_owner)
    for tenant, name, version, cid, tag, dedup, peft_config in event["versions"]:
        blob = blobs.get(cid)
        if blob is None:
            blob = blobs[cid] = t.get("blobs", cid.encode())
        if blob["refs"] == 0:
            shard(blob["shard"], blob["layout_id"])["live"] += 1
        blob["refs"] += 1
        owners[f"{cid}/{tenant}"] = owners.get(f"{cid}/{tenant}", 0) + 1
        lay = layout(blob["layout_id"])
        nkey = f"{tenant}/{name}"
        rec = names.get(nkey) or t.get("names", nkey.encode()) or {"next": 1, "latest": None, "latest_cid": None}
        rec["next"] = max(rec["next"], version + 1)
        if version >= (rec["latest"] or 0):  # the latest's content id rides along: resolve is 2 gets
            rec["latest"], rec["latest_cid"] = version, cid
        names[nkey] = rec
        t.put("versions", version_key(tenant, name, version), {
            "tenant": tenant, "name": name, "version": version, "content_id": cid,
            "layout_id": blob["layout_id"], "base": lay["layout"]["base"], "nbytes": blob["length"],
            "created": event["time"], "deleted": False, "deduplicated": bool(dedup),
            "peft_config": peft_config, "seq": event["seq"],
        })
        if tag:
            t.put("tags", f"{tenant}/{name}:{tag}".encode(), {"version": version, "content_id": cid})
    for db, recs in (("layouts", layouts), ("shards", shards), ("blobs", blobs), ("names", names)):
        for key, value in recs.items():
            t.put(db, key.encode(), value)
    for key, n in owners.items():
        t.put("owners", key.encode(), int(t.get("owners", key.encode()) or 0) + n)


def _apply_compact(t: Txn, event: dict[str, Any]) -> None:
    """Moves ([cid, row, shard, offset]) switch locations; dead rows are dropped; the old
    shards are marked retired (their objects are deleted by a later sweep)."""
    shards: dict[str, dict[str, Any]] = {}

    def shard(key: str) -> dict[str, Any]:
        if key not in shards:
            shards[key] = t.get("shards", key.encode()) or {"layout_id": event["layout_id"], "live": 0, "total": 0}
        return shards[key]

    lay = t.get("layouts", event["layout_id"].encode())
    for cid, row, key, offset in event["moves"]:
        blob = t.get("blobs", cid.encode())
        live = 1 if blob["refs"] > 0 else 0
        old = shard(blob["shard"])
        old["total"] -= 1
        old["live"] -= live
        blob.update(row=row, shard=key, offset=offset, length=event["length"])
        t.put("blobs", cid.encode(), blob)
        new = shard(key)
        new["total"] += 1
        new["live"] += live
        lay["next_row"] = max(lay["next_row"], row + 1)
    for cid in event["drops"]:
        blob = t.get("blobs", cid.encode())
        if blob is not None and blob["refs"] == 0:
            shard(blob["shard"])["total"] -= 1
            t.delete("blobs", cid.encode())
    for key in event["retired"]:
        shard(key)["retired_at"] = event["time"]
    t.put("layouts", event["layout_id"].encode(), lay)
    for key, rec in shards.items():
        t.put("shards", key.encode(), rec)


def apply_event(t: Txn, event: dict[str, Any]) -> None:
    # a key read back from the log could be planted ("/etc/x", "packs/../.."): checked against the
    # writer's grammar before it reaches the index (InvalidKey, an IntegrityError: nothing applied)
    check_event_keys(event)
    kind = event["kind"]
    if kind == "publish":
        _apply_publish(t, event)
    elif kind == "tag":
        target = t.get("versions", version_key(event["tenant"], event["name"], event["version"]))
        t.put("tags", f"{event['tenant']}/{event['name']}:{event['tag']}".encode(),
              {"version": event["version"], "content_id": target["content_id"]})
    elif kind == "untag":
        t.delete("tags", f"{event['tenant']}/{event['name']}:{event['tag']}".encode())
    elif kind == "delete":
        tenant, name, version = event["tenant"], event["name"], event["version"]
        vkey = version_key(tenant, name, version)
        rec = t.get("versions", vkey)
        if rec is not None and not rec["deleted"]:
            rec["deleted"] = True
            rec["deleted_at"] = event["time"]
            t.put("versions", vkey, rec)
            _change_refs(t, rec["content_id"], -1)
            _change_owner(t, rec["content_id"], tenant, -1)
            for k, v in list(t.scan("tags", f"{tenant}/{name}:".encode())):
                if v["version"] == version:
                    t.delete("tags", k)
            nkey = f"{tenant}/{name}".encode()
            names = t.get("names", nkey)
            names["latest"], names["latest_cid"] = _latest(t, tenant, name)
            t.put("names", nkey, names)
    elif kind == "base":
        t.put("bases", event["base"].encode(), event["shapes"])
    elif kind == "compact":
        _apply_compact(t, event)
    elif kind == "sweep":
        for key in event["shards"]:
            t.delete("shards", key.encode())
    elif kind == "quarantine":
        for cid in event["content_ids"]:
            blob = t.get("blobs", cid.encode())
            if blob is not None:
                blob["state"] = "damaged"
                t.put("blobs", cid.encode(), blob)
    else:
        raise IntegrityError(f"unknown event kind {kind!r} at seq {event.get('seq')}")
    t.put("events", seq_key(event["seq"]), summarize(event))
    t.put("meta", b"last_seq", event["seq"])
