"""How a store is opened: :class:`StoreConfig` (the ``Store.open`` options) and where its index lives."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .format.adapter import AdapterLimits
from .format.packs import SHARD_TARGET_BYTES
from .storage import LocalStorage, Storage, open_storage
from .storage.retry import RetryPolicy


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
    # index checkpoints (checkpoint.py): every N commits or T seconds, and at a clean close
    checkpoint_every: int = 1000
    checkpoint_interval_s: float = 600.0  # at 10^6 adapters a checkpoint is ~600 MB: not every minute
    checkpoint_keep: int = 3  # `sweep` deletes older ones
    follow_interval_s: float = 0.2  # a read-only store polls the log this often (0: never)

    def __post_init__(self) -> None:
        if self.shard_target_bytes < 1 or self.max_batch < 1:
            raise ValueError("shard_target_bytes and max_batch must be positive")
        if not 0 < self.lease_renew_s < self.lease_ttl_s:
            raise ValueError("lease_renew_s must be positive and shorter than lease_ttl_s")
        if self.checkpoint_every < 1 or self.checkpoint_interval_s <= 0 or self.checkpoint_keep < 1:
            raise ValueError("checkpoint_every, checkpoint_interval_s and checkpoint_keep must be positive")
        if self.follow_interval_s < 0:
            raise ValueError("follow_interval_s must be >= 0 (0: do not follow the log)")


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
