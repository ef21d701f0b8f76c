"""The compiled one-pass reader (``csrc/mint_read.c``), built on first use and bound to
python-xxhash's own xxh3-128, so its digests come from the code that wrote the content ids.

:func:`reader` is the module, or None when it cannot be had (no compiler or no Python
headers, a failed build, an xxhash build without the symbols, a failed self-check, or
``MINT_READ_NATIVE=0``); :mod:`.verified` then reads in Python, chunk by chunk on one thread.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np

from .. import native
from ..format.hashing import content_id

SOURCE = Path(__file__).with_name("csrc") / "mint_read.c"
_SYMBOLS = ("XXH3_createState", "XXH3_freeState", "XXH3_128bits_reset", "XXH3_128bits_update",
            "XXH3_128bits_digest")


def _flags() -> tuple[str, ...]:
    return ("-O3", "-march=native", "-fPIC", "-shared", "-pthread", f"-I{sysconfig.get_paths()['include']}")


_threads = 1  # what the module was last set to: a forked child starts its workers again with it


def reader(threads: int) -> ModuleType | None:
    """The loaded module, set to ``threads`` readers per large row (the caller and ``threads - 1``
    workers), or None (one warning says why)."""
    global _threads
    mod = _loaded()
    if mod is None:
        return None
    try:
        mod.set_threads(threads)
    except OSError as e:  # (no thread could be started)
        warnings.warn(f"the compiled row reader's threads could not start, rows are read in Python: {e}",
                      stacklevel=3)
        return None
    _threads = threads
    return mod


@functools.cache
def _loaded() -> ModuleType | None:
    try:
        mod = _load()
    except (native.BuildError, OSError, ImportError, AttributeError, ValueError) as e:
        warnings.warn(f"the compiled row reader is unavailable, rows are read in Python: {e}", stacklevel=4)
        return None
    os.register_at_fork(after_in_child=lambda: mod.set_threads(_threads))  # (a child has no workers)
    return mod


def _load() -> ModuleType:
    path = native.build(SOURCE, _flags(), sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    spec = importlib.util.spec_from_file_location("_mint_read", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lib = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)  # (loaded: the same copy)
    names = list(_SYMBOLS)
    if hasattr(lib, "XXH3_128bits_update_dispatch"):  # the runtime-dispatched (AVX2/AVX-512) update
        names[3] = "XXH3_128bits_update_dispatch"
    mod.bind(*(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names))
    mod.set_threads(2)  # the check reads its large row through the workers' path too
    try:
        _self_check(mod)
    finally:
        mod.set_threads(1)
    return mod


def _self_check(mod: ModuleType) -> None:
    """A row read through the module must give python-xxhash's content id, in one chunk and in
    several, and a wrong id must be told apart. ``copy_row``'s one-pass hash (its own XXH3) is
    checked too, at the lengths where its stripes, blocks and last stripe meet; if it ever
    disagrees with python-xxhash it is turned off (one warning) and the module hashes with
    python-xxhash alone."""
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8)
    fd = os.memfd_create("mint-read-check") if hasattr(os, "memfd_create") else None
    if fd is None:
        return
    try:
        os.write(fd, data.tobytes())
        for n in (1000, len(data) - 7):
            want = content_id("layout", data[3 : 3 + n])
            out = np.empty(n, np.uint8)
            if (mod.read_row(fd, 3, n, out, "layout", want) != 0 or not np.array_equal(out, data[3 : 3 + n])
                    or mod.read_row(fd, 3, n, out, "layout", _wrong(want)) != 1):
                raise ValueError("its self-check against python-xxhash failed")
    finally:
        os.close(fd)
    if not _copies_agree(mod, data):
        mod.set_one_pass(False)
        warnings.warn("the compiled row reader's one-pass hash disagrees with python-xxhash; rows are hashed "
                      "by python-xxhash and then copied", stacklevel=5)
        if not _copies_agree(mod, data):
            raise ValueError("its copy_row self-check against python-xxhash failed")


# row lengths for a 32-byte layout id around XXH3's edges: 240 bytes (the long path starts above
# it), a stripe (64), a block (1024) and one more stripe past a block
_EDGES = (208, 209, 210, 1000, 992, 993, 1023, 1024, 1025, 2016, 2017, 2081, 16 * 1024 + 31)


def _copies_agree(mod: ModuleType, data: np.ndarray) -> bool:
    for lid in ("layout", "0123456789abcdef0123456789abcdef"):
        for n in (*_EDGES, len(data) - 7):
            want = content_id(lid, data[3 : 3 + n])
            copied = np.zeros(n, np.uint8)
            if (mod.copy_row(data, 3, n, copied, lid, want) != 0 or not np.array_equal(copied, data[3 : 3 + n])
                    or mod.copy_row(data, 3, n, copied, lid, _wrong(want)) != 1):
                return False
    return True


def _wrong(cid: str) -> str:
    return cid[:-1] + ("0" if cid[-1] != "0" else "1")
