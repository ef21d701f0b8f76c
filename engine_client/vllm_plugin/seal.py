"""An entry's seal: the cache serves an entry only if this cache wrote it, unchanged since.

``.mint-digests.json`` in an entry names its content id, its export format and, per file,
its xxh3-128 and its ``(size, inode, mtime_ns, ctime_ns)``, and carries an HMAC-SHA256 of
all that under the cache's key (:func:`~.cache_root.load_key`, private to the user).

Why a keyed seal, and not a check against the content id the entry is named by: a content id
is xxh3-128 of (layout id, row bytes), and an entry holds PEFT files *exported* from the row
(the stored or a synthesised config, scalings folded into B in float32 for vLLM): the row,
and so the content id, cannot be computed back from the files. Nor is xxh3 a cryptographic
hash: it identifies content, it does not stop someone who crafts bytes to match. The digests
file alone proves nothing either, whoever can plant files can write it too. The key is what
they lack: a planted entry (files copied in, a cache directory restored or shared, files left
while the directory was open to others) has no valid seal and is never served; the row is
read (checked against its content id) and the entry made again, or, if its bytes are exactly
what the row gives, sealed as it is.

Why the stat, and what a hit costs: a sealed file cannot change in place without its ctime
changing (no unprivileged process can set a ctime back), and cannot be replaced without its
inode changing, so a matching stat, under a valid seal, says the bytes are those sealed, with
no keyed pass over them: the check is one small JSON read, one HMAC over it (microseconds)
and one ``stat`` per file. The xxh3 pass that follows (the file read once from the page
cache, at memory speed, as before) is for bit rot, which no stat shows. Not covered: this
user or root (they can read the key, and ptrace vLLM); a filesystem with coarse timestamps,
where a write in the same tick as the seal keeps the ctime (then the xxh3 still sees it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from mint_store.storage import fsync_dir, write_synced

DIGESTS = ".mint-digests.json"  # in every entry: its seal, checked on every hit
# how an entry's files were made from its row: an entry of another format is made again (or, if
# its bytes are what this format gives, kept), so a change of the export reaches cached entries
# (format 2: per-module scalings folded into B for vLLM; entries of format 1 kept them apart)
FORMAT = 2
_CHUNK = 1 << 20


def seal(entry: Path, content_id: str, key: bytes, files: Mapping[str, bytes]) -> bool:
    """Seal ``entry`` if it holds exactly ``files`` (names and bytes), files this user owns.

    Returns False, writing nothing, if it does not (or a file changed while it was read).
    The digests file is durable when this returns True (the directory fsynced with it).
    """
    try:
        names = {p.name for p in entry.iterdir()} - {DIGESTS}
        if names != set(files):
            return False
        record = {}
        for name in sorted(files):
            got = _read(entry / name, files[name])
            if got is None:
                return False
            record[name] = got
    except OSError:
        return False
    doc: dict[str, Any] = {"content_id": content_id, "format": FORMAT, "files": record}
    doc["mac"] = _mac(key, doc)
    tmp = entry / f"{DIGESTS}.{uuid.uuid4().hex[:8]}.tmp"  # (an older entry's file is replaced whole)
    write_synced(tmp, [json.dumps(doc).encode()])
    os.replace(tmp, entry / DIGESTS)
    fsync_dir(entry)
    return True


def is_sealed(entry: Path, content_id: str, key: bytes) -> bool:
    """Whether ``entry`` is as this cache sealed it for ``content_id`` (see the module notes)."""
    try:
        doc = json.loads((entry / DIGESTS).read_bytes())
        mac = doc.pop("mac")
        if not (isinstance(mac, str) and hmac.compare_digest(mac, _mac(key, doc))):
            return False  # not sealed with this key: planted, or from an older version
        files = doc["files"]
        if doc["content_id"] != content_id or doc["format"] != FORMAT:
            return False  # sealed for another name (moved here), or another export
        if set(files) != {p.name for p in entry.iterdir()} - {DIGESTS}:
            return False
        if any(_sig(os.stat(entry / name, follow_symlinks=False)) != rec["stat"] for name, rec in files.items()):
            return False  # changed or replaced since sealed
        return all(_xxh3(entry / name) == rec["xxh3"] for name, rec in files.items())  # bit rot
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing, unreadable, not ours
        return False


def _read(path: Path, expect: bytes) -> dict[str, Any] | None:
    """The record of a file holding exactly ``expect``, owned by this user; None otherwise."""
    want = memoryview(expect).cast("B")
    h = xxhash.xxh3_128()
    pos = 0
    with open(path, "rb") as f:
        before = os.fstat(f.fileno())
        if before.st_uid != os.geteuid() or before.st_size != len(want):
            return None  # another user's file could be changed by them after it is sealed
        while chunk := f.read(_CHUNK):
            if want[pos:pos + len(chunk)] != chunk:
                return None
            h.update(chunk)
            pos += len(chunk)
        after = os.fstat(f.fileno())
    if pos != len(want) or _sig(before) != _sig(after):  # changed while read: sealed next time, maybe
        return None
    return {"xxh3": str(h.hexdigest()), "stat": _sig(before)}


def _sig(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _mac(key: bytes, doc: Mapping[str, Any]) -> str:
    return hmac.new(key, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


def _xxh3(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return str(h.hexdigest())
