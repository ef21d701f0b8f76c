"""The cache directory is private to its user, and holds the key its entries are sealed with.

Whoever can create or change files under the cache directory decides what vLLM loads, so
before anything in it is used:

- the directory is created ``0700`` when missing; an existing one must be owned by this
  user and writable by nobody else (group or others), else :class:`~.errors.UnsafeCacheDir`;
- every directory on the way to it, the symlinks followed too, must be owned by this user
  or root and not writable by others (a sticky one such as ``/tmp`` is fine: there no one
  can rename or delete what another owns), else someone could swap the cache directory for
  their own after it was checked. A group-writable one is accepted only when the group is
  the user's own private group (same name as the user, the default of many distributions);
- ``entries/``, ``tmp/`` and ``leases/`` inside it: real directories (no symlinks), owned
  by this user, writable by nobody else;
- ``.mint-key``: 32 random bytes, created ``0600`` (write, fsync, then hard link: another
  process racing sees the whole key or none), read once per cache into memory; one not owned
  by this user or that others may read is refused (a key someone else knows seals nothing).

Everything is checked when a cache opens (and the plugin checks at start); the files of the
entries are then checked on every hit (:mod:`.seal`).
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import secrets
import stat
import uuid
from pathlib import Path

from mint_store.storage import fsync_dir

from .errors import UnsafeCacheDir

KEY_NAME = ".mint-key"
KEY_BYTES = 32
FIX = "set MINT_VLLM_CACHE_DIR to a directory of your own"


def prepare_root(root: str | os.PathLike[str]) -> Path:
    """Create the cache directory (``0700``) if missing, and check it and the way to it.

    Parameters
    ----------
    root
        The cache directory (``MINT_VLLM_CACHE_DIR``).

    Returns
    -------
    Path
        ``root`` as given.

    Raises
    ------
    UnsafeCacheDir
        ``root`` or a directory above it could be changed by another user; the message says how to fix it.
    """
    path = Path(root)
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile: checked below
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # exactly, whatever the umask
    _check_way(path)
    st = _stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheDir(f"MinT vLLM cache {path} is not a directory: {FIX}")
    _check_own(path, st, "MinT vLLM cache directory")
    return path


def private_dir(path: Path) -> None:
    """``path`` (inside a checked cache directory): made ``0700`` if missing, else checked."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):  # a symlink could lead anywhere
        raise UnsafeCacheDir(f"{path} is not a directory (a symlink?): remove it, the cache makes it again")
    _check_own(path, st, "MinT vLLM cache directory")


def load_key(root: Path) -> bytes:
    """The cache's sealing key (``root/.mint-key``), made on first use."""
    path = root / KEY_NAME
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            _make_key(root, path)  # or another process did: read below
            continue
        except OSError as e:  # ELOOP: a symlink
            raise UnsafeCacheDir(f"MinT vLLM cache key {path} cannot be opened as a file of its own ({e}): "
                                 f"remove it (every entry is then checked against the store once)") from e
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            key = f.read(KEY_BYTES + 1)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise UnsafeCacheDir(f"MinT vLLM cache key {path} is not private to uid {os.geteuid()} (owner uid "
                                 f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): remove it (every entry is "
                                 f"then checked against the store once and sealed with a new key)")
        if len(key) != KEY_BYTES:
            raise UnsafeCacheDir(f"MinT vLLM cache key {path} holds {len(key)} bytes, not {KEY_BYTES}: not one "
                                 f"this cache wrote; remove it")
        return key
    raise UnsafeCacheDir(f"MinT vLLM cache key {path} keeps disappearing: is another program deleting it?")


def _make_key(root: Path, path: Path) -> None:
    tmp = root / f"{KEY_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # the first link wins; every process reads that key
            os.link(tmp, path)
        fsync_dir(root)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _check_own(path: Path, st: os.stat_result, what: str) -> None:
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeCacheDir(f"{what} {path} is owned by uid {st.st_uid}, not by this process's uid {uid}: "
                             f"`chown {uid} {path}`, or {FIX}")
    if st.st_mode & 0o022:
        raise UnsafeCacheDir(f"{what} {path} is writable by its group or others (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}): `chmod 700 {path}`, or {FIX}")


def _check_way(path: Path) -> None:
    """Every directory above ``path``, as written and as the symlinks resolve."""
    absolute = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    uid = os.geteuid()
    for d in dict.fromkeys([*absolute.parents, *real.parents]):  # ordered, each once
        st = _stat(d)
        if st.st_uid not in (uid, 0):
            raise UnsafeCacheDir(f"MinT vLLM cache {path}: {d} above it is owned by uid {st.st_uid} (neither this "
                                 f"process's uid {uid} nor root), who could replace the cache: {FIX}")
        if st.st_mode & stat.S_ISVTX:  # sticky: entries only their owner may rename or delete
            continue
        if st.st_mode & 0o002 or (st.st_mode & 0o020 and not _private_group(st.st_gid)):
            raise UnsafeCacheDir(f"MinT vLLM cache {path}: {d} above it is writable by "
                                 f"{'others' if st.st_mode & 0o002 else 'its group'} (mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}), who could replace the cache: "
                                 f"`chmod go-w {d}`, or {FIX}")


def _private_group(gid: int) -> bool:
    """The user's own group (user private groups: its primary group, named as the user, no other members)."""
    try:
        group = grp.getgrgid(gid)
        return gid == os.getegid() and group.gr_name == pwd.getpwuid(os.geteuid()).pw_name and not group.gr_mem
    except KeyError:
        return False


def _stat(path: Path) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as e:
        raise UnsafeCacheDir(f"MinT vLLM cache {path}: cannot look at {e.filename or path} ({e.strerror}): "
                             f"{FIX}") from e
