"""C sources built on first use with the machine's compiler, cached per machine.

A source is compiled with ``$CC`` (else ``cc`` or ``gcc``) into ``$MINT_KERNEL_CACHE``
(default ``~/.cache/mint_store/kernels``), under a name keyed by the source and the headers it
includes from its folder, the compiler and its version, the flags and the CPU
(``-march=native`` code runs only where it was built). Concurrent builders each write their own
file and rename it into place. Without a compiler, or when the build fails,
:class:`BuildError` says why; every caller has a pure-Python or torch path to fall back on.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CACHE_ENV", "BuildError", "build", "compiler", "library_path"]

CACHE_ENV = "MINT_KERNEL_CACHE"


class BuildError(RuntimeError):
    """A C source could not be built: no compiler, or the compiler failed (the message says which)."""


def compiler() -> str:
    """The C compiler sources are built with; :class:`BuildError` when there is none."""
    named = os.environ.get("CC")
    cc = shutil.which(named) if named else shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError(f"no C compiler {named!r} found (set CC, or install gcc: apt-get install -y gcc)" if named
                         else "no C compiler found (set CC, or install gcc: apt-get install -y gcc)")
    return cc


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the model name and feature flags of this CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep))) or platform.machine()


def _sources(source: Path) -> list[str]:
    """The text of ``source`` and of the headers beside it that it includes (``#include "x.h"``),
    so that a changed header is a new build."""
    text = source.read_text()
    names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, flags=re.MULTILINE)
    return [text, *((source.parent / n).read_text() for n in names)]


def library_path(source: Path, flags: Sequence[str], suffix: str = ".so", root: Path | None = None) -> Path:
    """Where this machine's build of ``source`` lives (it may not exist yet)."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([*_sources(source), cc, version, *flags, _cpu_id()]).encode()).hexdigest()
    if root is None and os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV])
    elif root is None:
        try:
            root = Path.home() / ".cache" / "mint_store" / "kernels"
        except RuntimeError:  # no home directory (HOME unset, no passwd entry)
            root = _shared_tmp_dir()
    return root / f"{source.stem}-{key[:16]}{suffix}"


def _shared_tmp_dir() -> Path:
    """This user's own directory under the system's temporary directory, for a home that cannot
    be written. Per user, mode 0700, and refused unless this user owns it and nobody else may
    write it: /tmp is shared, and a library another user planted there would run in this process
    (its name is a hash of inputs anyone can read)."""
    d = Path(tempfile.gettempdir()) / f"mint_store-kernels-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise BuildError(f"{d} is not a directory of this user's that only it may write; remove it, or set "
                         f"{CACHE_ENV} to a directory of your own")
    return d


def build(source: Path, flags: Sequence[str], suffix: str = ".so") -> Path:
    """Compile ``source`` with ``flags`` unless this machine's build exists; its path.

    Raises
    ------
    BuildError
        No compiler, or the compiler failed (its messages are in the error). A cache
        directory that cannot be written (a read-only home) falls back to the system's
        temporary directory first.
    """
    out = library_path(source, flags, suffix)
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out.parent)
    except OSError:
        out = library_path(source, flags, suffix, _shared_tmp_dir())
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler(), *flags, "-o", tmp, str(source)], capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise BuildError(f"compiling {source.name} failed:\n{done.stderr.strip()}")
        os.replace(tmp, out)  # atomic: a concurrent builder's identical file may land first
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
