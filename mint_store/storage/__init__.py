"""Where objects live: a local directory (default) or any fsspec URL (``s3://`` via s3fs).

:class:`Storage` (base.py) is the abstraction; :class:`LocalStorage` (local.py) and
:class:`FsspecStorage` (remote.py) implement it; :func:`open_storage` picks one for a URL.
"""

from __future__ import annotations

import os
from typing import Any

from .base import Storage, joined_bytes
from .durable import fsync_dir
from .local import LocalStorage, write_synced
from .remote import FsspecStorage

__all__ = [
    "FsspecStorage",
    "LocalStorage",
    "Storage",
    "fsync_dir",
    "joined_bytes",
    "open_storage",
    "write_synced",
]


def open_storage(url: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> Storage:
    """A directory path, ``file://`` URL, or any fsspec URL (``s3://bucket/prefix``)."""
    text = os.fspath(url)
    if text.startswith("file://"):
        return LocalStorage(text[len("file://") :])
    if "://" not in text:
        return LocalStorage(text)
    return FsspecStorage(text, storage_options=storage_options)
