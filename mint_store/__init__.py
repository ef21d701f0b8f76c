"""MinT Store: a content-addressed store of LoRA adapters (Zarr v3 packs, LMDB index, commit log).

The public API is what this module exports (``__all__``); other modules are internal and
may change. Typical use::

    from mint_store import Store, load_peft_dir

    with Store.open("./mint-data") as store:
        store.publish("acme", "support-bot", load_peft_dir("./my-lora", base="llama-3-8b"))
        adapter = store.load("acme/support-bot")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

if TYPE_CHECKING:
    from .config import StoreConfig
    from .errors import (
        AdapterNotFound,
        BaseMismatch,
        BaseNotFound,
        BlobNotFound,
        CommitConflict,
        CommitInDoubt,
        Conflict,
        DamagedAdapter,
        IndexFormatMismatch,
        IntegrityError,
        InvalidAdapter,
        InvalidBaseConfig,
        InvalidKey,
        InvalidName,
        LayoutNotFound,
        LimitExceeded,
        MintError,
        NotFound,
        NotTheWriter,
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
    from .format.adapter import Adapter, AdapterLimits, LoraModule, make_adapter
    from .format.layout import Layout
    from .maintenance.compaction import CompactionPolicy, CompactionReport, compact
    from .maintenance.fsck import FsckReport
    from .peft.directory import load_peft_dir, save_peft_dir
    from .results import Location, PublishResult, VersionInfo
    from .storage import Storage, open_storage
    from .storage.retry import RetryPolicy
    from .store import Store

# name -> the module that defines it (never a name of a submodule: importing that
# submodule would replace the attribute). Loaded on first use (PEP 562), so that
# ``import mint_store`` (and the client, which imports its value objects from here)
# stays light: no torch, zarr or lmdb until a name that needs them is used.
_EXPORTS = {
    "Adapter": ".format.adapter",
    "AdapterLimits": ".format.adapter",
    "AdapterNotFound": ".errors",
    "BaseMismatch": ".errors",
    "BaseNotFound": ".errors",
    "BlobNotFound": ".errors",
    "CommitConflict": ".errors",
    "CommitInDoubt": ".errors",
    "CompactionPolicy": ".maintenance.compaction",
    "CompactionReport": ".maintenance.compaction",
    "Conflict": ".errors",
    "DamagedAdapter": ".errors",
    "FsckReport": ".maintenance.fsck",
    "IndexFormatMismatch": ".errors",
    "IntegrityError": ".errors",
    "InvalidAdapter": ".errors",
    "InvalidKey": ".errors",
    "InvalidBaseConfig": ".errors",
    "InvalidName": ".errors",
    "Layout": ".format.layout",
    "LayoutNotFound": ".errors",
    "LimitExceeded": ".errors",
    "Location": ".results",
    "LoraModule": ".format.adapter",
    "MintError": ".errors",
    "NotFound": ".errors",
    "NotTheWriter": ".errors",
    "ObjectChanged": ".errors",
    "ObjectExists": ".errors",
    "PublishResult": ".results",
    "ReadOnlyStore": ".errors",
    "RemoteSourceError": ".errors",
    "RetryPolicy": ".storage.retry",
    "StaleLocation": ".errors",
    "Storage": ".storage",
    "Store": ".store",
    "StoreClosed": ".errors",
    "StoreConfig": ".config",
    "StoreNotFound": ".errors",
    "StoreUnavailable": ".errors",
    "TagNotFound": ".errors",
    "UnsupportedAdapter": ".errors",
    "VersionDeleted": ".errors",
    "VersionInfo": ".results",
    "VersionNotFound": ".errors",
    "WriterFenced": ".errors",
    "WriterLocked": ".errors",
    "compact": ".maintenance.compaction",
    "load_peft_dir": ".peft.directory",
    "make_adapter": ".format.adapter",
    "open_storage": ".storage",
    "save_peft_dir": ".peft.directory",
}

__all__ = [
    "Adapter",
    "AdapterLimits",
    "AdapterNotFound",
    "BaseMismatch",
    "BaseNotFound",
    "BlobNotFound",
    "CommitConflict",
    "CommitInDoubt",
    "CompactionPolicy",
    "CompactionReport",
    "Conflict",
    "DamagedAdapter",
    "FsckReport",
    "IndexFormatMismatch",
    "IntegrityError",
    "InvalidAdapter",
    "InvalidBaseConfig",
    "InvalidKey",
    "InvalidName",
    "Layout",
    "LayoutNotFound",
    "LimitExceeded",
    "Location",
    "LoraModule",
    "MintError",
    "NotFound",
    "NotTheWriter",
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
    "load_peft_dir",
    "make_adapter",
    "open_storage",
    "save_peft_dir",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
