"""MinT Store: a content-addressed store of LoRA adapters (Zarr v3 packs, LMDB index, commit log).

The public API is what this module exports (``__all__``); other modules are internal and
may change. Typical use::

    from mint_store import Store, load_peft_dir

    with Store.open("./mint-data") as store:
        store.publish("acme", "support-bot", load_peft_dir("./my-lora", base="llama-3-8b"))
        adapter = store.load("acme/support-bot")
"""

from __future__ import annotations

from .adapter import Adapter, AdapterLimits, LoraModule, make_adapter
from .compaction import CompactionPolicy, CompactionReport, compact
from .config import StoreConfig
from .errors import (
    AdapterNotFound,
    BaseMismatch,
    BaseNotFound,
    BlobNotFound,
    CommitConflict,
    Conflict,
    DamagedAdapter,
    IndexFormatMismatch,
    IntegrityError,
    InvalidAdapter,
    InvalidBaseConfig,
    InvalidName,
    LayoutNotFound,
    LimitExceeded,
    MintError,
    NotFound,
    ObjectChanged,
    ObjectExists,
    ReadOnlyStore,
    RemoteSourceError,
    StaleLocation,
    StoreClosed,
    StoreNotFound,
    StoreUnavailable,
    TagNotFound,
    UnsupportedAdapter,
    VersionDeleted,
    VersionNotFound,
    WriterFenced,
    WriterLocked,
)
from .fsck import FsckReport, fsck
from .layout import Layout
from .peft_format import load_peft_dir, save_peft_dir
from .results import Location, PublishResult, VersionInfo
from .retry import RetryPolicy
from .storage import Storage, open_storage
from .store import Store

__all__ = [
    "Adapter",
    "AdapterLimits",
    "AdapterNotFound",
    "BaseMismatch",
    "BaseNotFound",
    "BlobNotFound",
    "CommitConflict",
    "CompactionPolicy",
    "CompactionReport",
    "Conflict",
    "DamagedAdapter",
    "FsckReport",
    "IndexFormatMismatch",
    "IntegrityError",
    "InvalidAdapter",
    "InvalidBaseConfig",
    "InvalidName",
    "Layout",
    "LayoutNotFound",
    "LimitExceeded",
    "Location",
    "LoraModule",
    "MintError",
    "NotFound",
    "ObjectChanged",
    "ObjectExists",
    "PublishResult",
    "ReadOnlyStore",
    "RemoteSourceError",
    "RetryPolicy",
    "StaleLocation",
    "Storage",
    "Store",
    "StoreClosed",
    "StoreConfig",
    "StoreNotFound",
    "StoreUnavailable",
    "TagNotFound",
    "UnsupportedAdapter",
    "VersionDeleted",
    "VersionInfo",
    "VersionNotFound",
    "WriterFenced",
    "WriterLocked",
    "compact",
    "fsck",
    "load_peft_dir",
    "make_adapter",
    "open_storage",
    "save_peft_dir",
]
