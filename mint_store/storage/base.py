"""The storage abstraction: what the store needs from a place that holds objects.

Small and synchronous on purpose: the store calls it from its writer thread and from read
paths that must cost one system call (``os.preadv``) or one ranged GET per row.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from typing import Any

from ..errors import ObjectExists
from .retry import RetryPolicy, call_with_retry, retried


class Storage(ABC):
    url: str
    # set by the store from StoreConfig.retry; every method named in RETRIED goes through it
    retry: RetryPolicy = RetryPolicy()
    RETRIED: tuple[str, ...] = ("put", "get", "exists", "size", "read_into", "delete", "list", "make_durable")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.RETRIED:
            fn = cls.__dict__.get(name)
            if callable(fn) and not getattr(fn, "__mint_retried__", False):
                setattr(cls, name, retried(fn))

    @abstractmethod
    def zarr_store(self) -> Any:
        """The zarr Store over the same root (used to write and cross-check packs)."""

    @abstractmethod
    def put(self, key: str, data: Any) -> None:
        """Write one object durably and atomically (all or nothing).

        ``data`` is a bytes-like object or a list of them (written back to back).
        """

    @abstractmethod
    def put_if_absent(self, key: str, data: Any) -> None:
        """Like :meth:`put`, but create-only: raise ObjectExists (and change nothing) when
        ``key`` exists. Every object a commit names is written this way."""

    def create(self, key: str, data: Any) -> None:
        """:meth:`put_if_absent`, retried on transient errors (``retry``).

        Finding ``key`` holding exactly ``data`` is an earlier attempt's write, which landed
        though its answer was lost (a reset after the upload): done. That earlier attempt may
        be this one's own: the S3 client retries a request by itself, and its retry of a PUT
        that landed gets 412. Anything else there is another writer's object: ObjectExists,
        nothing changed. (Every object a commit writes is unique to it: a log event carries
        its writer's epoch and time, a shard its rows.)
        """

        def once() -> None:
            try:
                self.put_if_absent(key, data)
            except ObjectExists:
                if self.get(key) == joined_bytes(data):
                    return
                raise

        call_with_retry(self.retry, once)

    @abstractmethod
    def get_with_token(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and a token that changes whenever the object does."""

    @abstractmethod
    def replace_if(self, key: str, data: Any, token: str) -> None:
        """Overwrite ``key`` only if it still has ``token`` (compare-and-swap); raise
        ObjectChanged otherwise. Used for the writer lease only."""

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with the bytes at ``offset`` of object ``key`` in one read call."""

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        self.read_into(key, offset, memoryview(buf))
        return bytes(buf)

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def list(self, prefix: str) -> builtins.list[str]:
        """Keys under ``prefix`` (recursive), sorted."""

    def make_durable(self, keys: builtins.list[str]) -> None:  # noqa: B027 - object stores need nothing
        """Make objects written through the zarr store durable (fsync locally)."""

    def modified(self, key: str) -> float | None:
        """When the storage itself last wrote ``key`` (epoch seconds: a file's mtime, S3's
        Last-Modified), or None when it is gone or the backend keeps no such time. The
        storage's clock, not anything the object says (the sweep's grace period runs from it)."""
        return None

    def local_path(self, key: str) -> str | None:
        """A filesystem path for ``key`` when the bytes are local (lets the service sendfile)."""
        return None

    def incomplete_uploads(self) -> builtins.list[tuple[str, str, float]]:
        """Uploads begun and never completed nor aborted, as ``(key, upload id, start time)``.

        An object store's multipart upload (S3: objects of 100 MiB and more) left by a process
        killed mid-write: never listed as an object, yet its parts are stored (and billed).
        Other backends have none (a local temp file is an object, reported as an orphan).
        """
        return []

    def abort_upload(self, key: str, upload_id: str) -> None:  # noqa: B027 - no uploads to abort
        """Abort one of :meth:`incomplete_uploads`: its parts are deleted."""

    def check_conditional_writes(self) -> None:  # noqa: B027 - local links and memory:// are exact
        """Before a writer commits here: raise ReadOnlyStore unless create-only and compare-and-swap
        writes are refused when they should be (an object store may ignore the conditions)."""

    def close(self) -> None:  # noqa: B027
        pass


def joined_bytes(data: Any) -> bytes:
    parts = data if isinstance(data, list) else [data]
    return b"".join(memoryview(p).cast("B") for p in parts)
