"""How a store is opened: :class:`StoreConfig` (the ``Store.open`` options) and where its index lives."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .adapter import AdapterLimits
from .packs import SHARD_TARGET_BYTES
from .retry import RetryPolicy
from .storage import LocalStorage, Storage, open_storage


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    index_dir: str | None = None
    readonly: bool = False
    storage_options: dict[str, Any] | None = None
    shard_target_bytes: int = SHARD_TARGET_BYTES
    max_batch: int = 8192
    max_batch_bytes: int = 1 << 30
    limits: AdapterLimits = field(default_factory=AdapterLimits)
    lease_ttl_s: float = 10.0  # a writer that stops renewing is taken over after this
    lease_renew_s: float = 3.0
    # transient storage errors (S3 5xx/SlowDown, resets, EINTR); also the writer's recovery backoff
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if self.shard_target_bytes < 1 or self.max_batch < 1:
            raise ValueError("shard_target_bytes and max_batch must be positive")
        if not 0 < self.lease_renew_s < self.lease_ttl_s:
            raise ValueError("lease_renew_s must be positive and shorter than lease_ttl_s")


def default_index_dir(url: str) -> str:
    """``<store>/index`` for a local store; a per-URL directory under ~/.cache otherwise."""
    if "://" not in url or url.startswith("file://"):
        return str(Path(url.removeprefix("file://")) / "index")
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    base = os.environ.get("MINT_INDEX_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "mint-store")
    return os.path.join(base, digest)


def open_location(url: str | os.PathLike[str], config: StoreConfig) -> tuple[Storage, str]:
    """The storage at ``url`` and the index directory a store there uses under ``config``."""
    storage = open_storage(os.fspath(url), storage_options=config.storage_options)
    # the storage's own URL: memory://b/p and memory://b/p/ share one default index
    index_dir = config.index_dir or default_index_dir(
        str(storage.root) if isinstance(storage, LocalStorage) else storage.url
    )
    return storage, index_dir
