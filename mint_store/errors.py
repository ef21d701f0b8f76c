"""Every error the store raises. The service maps these to HTTP codes in one place."""

from __future__ import annotations


class MintError(Exception):
    """Base of all MinT Store errors. ``code`` is the stable machine-readable name."""

    code = "mint_error"


class InvalidName(MintError, ValueError):
    """A tenant, name, tag, version or ref that does not follow the grammar."""

    code = "invalid_name"


class InvalidAdapter(MintError, ValueError):
    """An adapter (files or tensors) that fails validation. Nothing was stored."""

    code = "invalid_adapter"


class UnsupportedAdapter(InvalidAdapter):
    """A well-formed adapter using a feature the store refuses (DoRA, embeddings, ...)."""

    code = "unsupported_adapter"


class BaseMismatch(InvalidAdapter):
    """The adapter's module shapes disagree with the registered base."""

    code = "base_mismatch"


class LimitExceeded(InvalidAdapter):
    """An input over a configured size limit."""

    code = "limit_exceeded"


class NotFound(MintError, KeyError):
    """Base of the lookups that found nothing."""

    code = "not_found"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else self.code


class StoreNotFound(NotFound):
    code = "store_not_found"


class AdapterNotFound(NotFound):
    code = "adapter_not_found"


class VersionNotFound(NotFound):
    code = "version_not_found"


class TagNotFound(NotFound):
    code = "tag_not_found"


class BlobNotFound(NotFound):
    code = "blob_not_found"


class LayoutNotFound(NotFound):
    code = "layout_not_found"


class BaseNotFound(NotFound):
    code = "base_not_found"


class VersionDeleted(MintError, LookupError):
    """The version exists but was deleted."""

    code = "version_deleted"


class Conflict(MintError, RuntimeError):
    """The request conflicts with the current state (e.g. a base registered differently)."""

    code = "conflict"


class WriterLocked(MintError, RuntimeError):
    """Another process holds the writer lock of this index."""

    code = "writer_locked"


class ReadOnlyStore(MintError, RuntimeError):
    code = "read_only"


class StoreClosed(MintError, RuntimeError):
    code = "store_closed"


class StoreUnavailable(MintError, RuntimeError):
    """The storage refused a write (disk full, permissions, an outage); nothing was committed.

    The writer recovers by itself (it replays the log and probes the storage, with
    backoff); until it has, writes fail fast with this error. Retry later.
    """

    code = "store_unavailable"


class IndexFormatMismatch(MintError, RuntimeError):
    """The local index was written in another format (format 2: pickled records).

    Its values are never decoded; a writable open rebuilds it from the commit log.
    """

    code = "index_format"


class IntegrityError(MintError, RuntimeError):
    """Bytes read back do not match their content id. Never served."""

    code = "integrity_error"


class DamagedAdapter(IntegrityError):
    """The row was quarantined by fsck --repair."""

    code = "damaged"


class StaleLocation(MintError, LookupError):
    """A location that no longer holds the row (compacted away): re-resolve."""

    code = "stale_location"


class CrashInjected(BaseException):
    """Raised by a fault-injection point. A BaseException so no handler swallows it."""
