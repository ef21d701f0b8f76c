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


class InvalidBaseConfig(InvalidAdapter):
    """A base's ``config.json`` that is missing, unreadable, or no transformers model is built from."""

    code = "invalid_base_config"


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


class ObjectExists(Conflict):
    """A create-only write found the object already there (nothing was overwritten)."""

    code = "object_exists"


class ObjectChanged(Conflict):
    """A compare-and-swap write found the object changed since it was read."""

    code = "object_changed"


class WriterLocked(MintError, RuntimeError):
    """Another writer holds this store's writer lease (or this index's lock).

    ``holder`` is the lease record's holder (host, pid, url) when known; ``url`` is the
    holder's service URL when it serves the store, so callers can send writes there.
    """

    code = "writer_locked"

    def __init__(self, message: str, *, holder: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}

    @property
    def url(self) -> str | None:
        url = self.holder.get("url")
        return url if isinstance(url, str) and url else None


class WriterFenced(MintError, RuntimeError):
    """This writer lost its lease (another writer took over): it can never commit again."""

    code = "writer_fenced"


class CommitConflict(WriterFenced):
    """The commit's log object (or a shard it names) already exists: another writer got
    there first. Nothing of this commit was acknowledged."""

    code = "commit_conflict"


class ShardTaken(CommitConflict):
    """A new shard's name is taken. By another writer, or (while this one holds the lease) by
    the writer before it, paused past its lease: shards it wrote before its commit was fenced
    are orphans no commit names, and the name is taken again one shard further on."""


class ReadOnlyStore(MintError, RuntimeError):
    code = "read_only"


class NotTheWriter(ReadOnlyStore):
    """A write sent to a read-only replica (or a standby): the writer is elsewhere.

    ``writer_url`` is the service URL in the store's writer lease, when the writer serves
    one; the service answers 405 with it (``Location`` header and ``writer_url`` field).
    """

    code = "not_the_writer"

    def __init__(self, message: str = "", *, writer_url: str | None = None) -> None:
        super().__init__(message)
        self.writer_url = writer_url


class StoreClosed(MintError, RuntimeError):
    code = "store_closed"


class StoreUnavailable(MintError, RuntimeError):
    """The storage refused a write (disk full, permissions, an outage); nothing was committed.

    The writer recovers by itself (it replays the log and probes the storage, with
    backoff); until it has, writes fail fast with this error. Retry later.
    """

    code = "store_unavailable"


class CommitInDoubt(StoreUnavailable):
    """The storage failed while this commit's log object was being written, and whether it
    landed is not known yet: if it did, the writer applies it when it recovers.

    Not retried by the client: sending a publish again could make a second version. Once
    the store is writable again, look (``versions``, ``resolve``) before sending it again.
    """

    code = "commit_in_doubt"


class IndexFormatMismatch(MintError, RuntimeError):
    """The local index was written in another format (format 2: pickled records).

    Its values are never decoded; a writable open rebuilds it from the commit log.
    """

    code = "index_format"


class IntegrityError(MintError, RuntimeError):
    """Bytes read back do not match their content id. Never served."""

    code = "integrity_error"


class LogGap(IntegrityError):
    """The log has no object at seq ``after + 1`` but holds later ones (from ``next_seq``): a
    follower waits on it for a bounded number of polls, then reports it (``/healthz`` degraded)."""

    code = "log_gap"

    def __init__(self, message: str, *, after: int, next_seq: int) -> None:
        super().__init__(message)
        self.after, self.next_seq = after, next_seq


class InvalidKey(IntegrityError):
    """A storage key outside the grammar the writer produces (``packs/<layout id>/rows/c/<n>/0``,
    mint_store.format.keys), read back from storage (a log event, a checkpoint, an index record), or
    one that would escape a storage backend's root. Corrupt or planted: never used for a read
    or a delete."""

    code = "invalid_key"


class DamagedAdapter(IntegrityError):
    """The row was quarantined by fsck --repair."""

    code = "damaged"


class StaleLocation(MintError, LookupError):
    """A location that no longer holds the row (compacted away): re-resolve."""

    code = "stale_location"


class RemoteSourceError(MintError, RuntimeError):
    """An ``hf://`` source could not be downloaded (endpoint down, refused, not a LoRA adapter)."""

    code = "remote_source_error"


class CrashInjected(BaseException):
    """Raised by a fault-injection point. A BaseException so no handler swallows it."""
