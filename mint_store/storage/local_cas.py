"""Compare-and-swap on a local directory with no lock: create-if-absent of version numbers.

The only atomic conditional primitives a local file system has are create-if-absent ones
(link(2), O_EXCL, mkdir). So a CAS'd key ``K`` keeps its values as immutable files
``K.v/<n>`` (``n`` zero-padded); the current value is the highest ``n``, its token ``v<n>``.
A CAS from ``v<n>`` writes its bytes to a temp file (fsynced) and links it as ``K.v/<n+1>``:
the link is atomic, fails with EEXIST if another CAS got there first, and makes only a
complete file visible; then the directory is fsynced (an acknowledged CAS survives power
loss). Nothing is held across the compare and the swap, so a process stopped (SIGSTOP, a
paused VM, a debugger) or killed anywhere holds nobody up: the old flock-based CAS let a
stopped holder block every later CAS of the writer lease in the kernel, forever.

Garbage collection: the winner of version ``m`` unlinks versions ``<= m - KEEP``. That opens
one hole, closed by a check: a CASer paused since it read ``v<n>`` may resume after ``n+1``
was collected and link ``n+1`` again. So right after its link each CASer lists the versions
and reports ObjectChanged if the newest is ``>= n + 1 + KEEP``.

Why every interleaving is safe (``H`` = the highest version ever linked):

- ``H`` is never unlinked: a version ``x`` is unlinked only by the winner of some
  ``m >= x + KEEP`` (or by a stale CASer, its own link, below ``H - KEEP``). So the highest
  listed version is always ``H``, the current value, and a version file's bytes never change
  while it exists (links are only ever made of complete, fsynced files).
- Two CASers from ``v<n>`` race on one name, ``n+1``; the kernel lets exactly one link win.
- A link of ``n+1`` succeeds either because ``n+1`` was never linked (this CAS is the one
  true successor of ``v<n>``: no lost update) or because it was linked and collected since,
  which took a winner of some ``m >= n + 1 + KEEP``. The listing after the link tells them
  apart: newest ``< n + 1 + KEEP`` means nothing was ever collected at ``n+1``, so the CAS
  won. Otherwise it fails; that may be a false failure (KEEP later CASes landed between
  this link and its listing, microseconds), which the lease survives (the writer re-reads or
  stands down); a false success never happens. The listing is one getdents call on a
  directory of ~KEEP entries, atomic against link/unlink in it (both lock the directory).
- Paused or killed between temp write and link: a temp file is left in the parent directory
  (fsck reports it, as for any write); nothing changed. Killed after the link, before the
  directory fsync: the CAS was not acknowledged; after power loss it is there or not.
- Readers list, take the highest, and read it; if it was collected in between (KEEP CASes
  later) they list again.

A legacy plain ``K`` file (stores made before this scheme; its token is the sha256 of its
bytes) keeps working: the first CAS from a sha256 token re-checks the bytes and links
``K.v/<1>`` (exclusive, so two migrating CASers cannot both win; a stale migrator is caught
by the same check). The plain file is then left in place, so create-if-absent of ``K`` (a
plain link) keeps failing with ObjectExists; readers prefer ``K.v`` whenever it has a version.
A process of an older version still CASes the plain file under its flock, which nobody reads
once ``K.v`` exists: stop the old writers and standbys of a local store before starting new ones.
"""

from __future__ import annotations

import builtins
import hashlib
import os
from pathlib import Path
from typing import Any, Protocol

from ..errors import BlobNotFound, ObjectChanged
from ..format.keys import check_relative_key
from .durable import fsync_dir


class CASDirectory(Protocol):
    """What a CAS needs of :class:`~.local.LocalStorage` (which calls in here: this module
    must not import it back)."""

    _root_s: str
    _durable_dirs: set[Path]

    def _path(self, key: str) -> Path: ...

    def _ensure_dir(self, d: Path) -> None: ...

    def _write_temp(self, path: Path, data: Any) -> Path: ...

    def _get_plain(self, key: str) -> bytes: ...


SUFFIX = ".v"  # K's versions live in the directory K.v
WIDTH = 20  # digits of a version's file name: they sort as numbers
KEEP = 16  # versions kept after each CAS: a reader has 16 CASes' time to read the one it listed


def vdir(storage: CASDirectory, key: str) -> Path:
    return storage._path(key + SUFFIX)


def versions(d: Path | str) -> builtins.list[int] | None:
    """The version numbers in directory ``d``, or None when it does not exist."""
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return sorted(int(n) for n in names if len(n) == WIDTH and n.isdigit())


def read_versioned(storage: CASDirectory, key: str) -> tuple[bytes, int] | None:
    """``(bytes, n)`` of ``key``'s highest version; None when ``key`` has none (a plain key)."""
    check_relative_key(key)  # (the f-string below bypasses LocalStorage._path's check)
    d = f"{storage._root_s}/{key}{SUFFIX}"  # a str, not a Path: this runs on every get
    while True:
        ns = versions(d)
        if not ns:
            return None
        try:
            with open(f"{d}/{ns[-1]:0{WIDTH}d}", "rb") as f:
                return f.read(), ns[-1]
        except FileNotFoundError:
            continue  # collected between the listing and the read: list again


def get_with_token(storage: CASDirectory, key: str) -> tuple[bytes, str]:
    got = read_versioned(storage, key)
    if got is not None:
        return got[0], f"v{got[1]}"
    data = storage._get_plain(key)
    return data, hashlib.sha256(data).hexdigest()


def replace_if(storage: CASDirectory, key: str, data: Any, token: str) -> None:
    changed = ObjectChanged(f"object {key!r} changed since it was read; not overwritten")
    if token.startswith("v") and token[1:].isdigit():
        _link_next(storage, key, data, int(token[1:]), changed)
        return
    # a legacy plain file, its token a sha256: migrate it to version 1 if it is unchanged
    if read_versioned(storage, key) is not None:
        raise changed  # migrated (and so changed) since the token was read
    try:
        current = hashlib.sha256(storage._get_plain(key)).hexdigest()
    except BlobNotFound:
        raise changed from None
    if current != token:
        raise changed
    _link_next(storage, key, data, 0, changed)


def _link_next(storage: CASDirectory, key: str, data: Any, n: int, changed: ObjectChanged) -> None:
    """Link ``data`` as version ``n + 1`` of ``key``; ObjectChanged unless it is now the newest."""
    d = vdir(storage, key)
    storage._ensure_dir(d)
    tmp = storage._write_temp(storage._path(key), data)  # beside K: fsck sees what a crash leaves
    name = d / f"{n + 1:0{WIDTH}d}"
    try:
        os.link(tmp, name)
    except FileExistsError:
        raise changed from None  # another CAS from v<n> won
    except FileNotFoundError:  # K.v was removed (delete) after we made it
        storage._durable_dirs.discard(d)
        raise changed from None
    finally:
        tmp.unlink()
    # listed at once, before the fsync: the window in which KEEP more CASes could land is tiny
    ns = versions(d) or []
    if ns and ns[-1] >= n + 1 + KEEP:  # n+1 may have been linked and collected before: stale
        name.unlink(missing_ok=True)  # garbage KEEP below the newest version; nobody reads it
        raise changed
    fsync_dir(d)  # the link survives power loss before the CAS is acknowledged
    for old in ns:
        if old > n + 1 - KEEP:
            break
        (d / f"{old:0{WIDTH}d}").unlink(missing_ok=True)


def delete(storage: CASDirectory, key: str) -> bool:
    """Remove ``key``'s versions, if it has a ``K.v``; True when it had one.

    Not atomic with a concurrent CAS and not used for the writer lease (it is released,
    never deleted).
    """
    d = vdir(storage, key)
    ns = versions(d)
    if ns is None:
        return False
    for n in ns:
        (d / f"{n:0{WIDTH}d}").unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError:
        pass  # something new appeared: a later delete finds it
    storage._durable_dirs.discard(d)
    return True


def public_key(rel: str) -> str | None:
    """The key a listed file stands for: ``K`` for ``K.v/<n>``; None for other files."""
    parent, _, name = rel.rpartition("/")
    if parent.endswith(SUFFIX) and len(name) == WIDTH and name.isdigit():
        return parent[: -len(SUFFIX)]
    return None
