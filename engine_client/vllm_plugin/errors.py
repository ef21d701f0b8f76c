"""Typed errors of the vLLM plugin that are not the resolver's answers to vLLM (those are in :mod:`.resolver`)."""

from __future__ import annotations

from mint_store.errors import MintError


class UnsafeCacheDir(MintError, PermissionError):
    """The cache directory (or a directory above it, or its key) could be changed or read by
    another user: nothing in it is trusted. The message names the path and the fix."""

    code = "unsafe_cache_dir"
