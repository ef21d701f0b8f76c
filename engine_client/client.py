"""``MintClient``: one async interface over the HTTP service or a store opened directly.

    client = MintClient("http://127.0.0.1:8470", token="...")   # the service
    client = MintClient("/data/mint")                           # a directory, file:// or s3://
    loc, row = await client.read("acme/chat:prod")              # verified against its content id

``MintClient(url)`` returns the right implementation for the URL. ``SyncMintClient`` is
the same interface for code without an event loop (it runs one in a thread).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncGenerator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mint_store.errors import BlobNotFound, MintError, StaleLocation
from mint_store.records import Location, PublishResult, VersionInfo

from .errors import BadRequest, ConnectionFailed, Forbidden, InvalidName, ServiceUnavailable, Unauthorized

if TYPE_CHECKING:
    from mint_store.adapter import Adapter
    from mint_store.blocks import RowBlocks
    from mint_store.layout import Layout
    from mint_store.store import Store

T = TypeVar("T")
log = logging.getLogger("mint.client")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    """Options of a client. HTTP ones apply to ``http(s)://``; store ones to the rest."""

    token: str | None = None
    connect_timeout: float = 10.0
    read_timeout: float = 60.0  # longest silence while reading a response
    request_timeout: float | None = 600.0  # one attempt, body included
    retries: int = 3  # extra attempts on 5xx and connection errors (never on 4xx)
    backoff: float = 0.05  # first retry delay; doubles per attempt, with jitter
    max_backoff: float = 2.0
    max_connections: int = 64
    resolve_batch: int = 10_000
    index_dir: str | None = None
    storage_options: Mapping[str, Any] | None = None
    readonly: bool = False  # a local store: never take the writer lease
    writable: bool = False  # a local store: take the writer lease at open, not at the first write
    workers: int = 8  # threads for blocking store calls
    poll_interval: float = 0.2  # change feed of a store written by another process

    def __post_init__(self) -> None:
        if self.retries < 0 or self.max_connections < 1 or self.workers < 1:
            raise ValueError("retries must be >= 0, max_connections and workers >= 1")
        if not 1 <= self.resolve_batch <= 10_000:
            raise ValueError("resolve_batch must be in 1..10000")
        for name in ("connect_timeout", "read_timeout", "backoff", "max_backoff", "poll_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One answer of the change feed. Pass ``last_seq`` as the next ``after``."""

    events: tuple[dict[str, Any], ...]
    last_seq: int
    head: int


def version_info(d: Mapping[str, Any]) -> VersionInfo:
    return VersionInfo(
        d["tenant"], d["name"], int(d["version"]), d["content_id"], d["layout_id"], int(d["nbytes"]), d["base"],
        float(d["created"]), bool(d["deleted"]), bool(d["deduplicated"]), tuple(d.get("tags", ())),
        d.get("peft_config"),
    )


def row_buffer(length: int, out: Any) -> tuple[Any, memoryview]:
    """``out`` (or a new array) and a writable byte view of exactly ``length`` bytes of it."""
    if out is None:
        import numpy as np

        out = np.empty(length, dtype=np.uint8)
    view = memoryview(out).cast("B")
    if view.readonly:
        raise ValueError("the destination buffer is read-only")
    if len(view) < length:
        raise ValueError(f"buffer of {len(view)} bytes is smaller than the row ({length})")
    return out, view[:length]


class MintClient:
    """Async client. ``MintClient(url, token=None, **options)``; options: :class:`ClientConfig`."""

    def __new__(cls, url: str | os.PathLike[str], token: str | None = None, **options: Any) -> MintClient:
        if cls is MintClient:
            text = os.fspath(url)
            if text.startswith(("http://", "https://")):
                from ._http import HttpMintClient

                return super().__new__(HttpMintClient)
            from ._local import StoreMintClient

            return super().__new__(StoreMintClient)
        return super().__new__(cls)

    def __init__(self, url: str | os.PathLike[str], token: str | None = None, **options: Any) -> None:
        self.url = os.fspath(url)
        self.config = ClientConfig(token=token, **options)
        self._layouts: dict[str, Layout] = {}

    async def __aenter__(self) -> MintClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- what each transport implements ----------------------------------------------------

    async def close(self) -> None:
        raise NotImplementedError

    async def _resolve_batch(self, refs: Sequence[str]) -> list[Location | MintError]:
        raise NotImplementedError

    async def read_row(self, loc: Location, out: Any = None, *, verify: bool = True) -> Any:
        """Read one row into ``out`` (or a new uint8 array); verified against its content id."""
        raise NotImplementedError

    async def read_ranges(self, loc: Location, ranges: Sequence[tuple[int, int]], out: Any) -> int:
        """Read byte ranges ``(offset, nbytes)`` of ``loc``'s row into the same offsets of ``out`` (a
        row-sized writable buffer) in one vectored read; returns the bytes read. Unverified: the
        caller checks each block against :meth:`row_blocks` (see :mod:`mint_store.blocks`)."""
        raise NotImplementedError

    async def row_blocks(self, loc: Location) -> RowBlocks | None:
        """The block digests the writer recorded for ``loc``'s row, checked against its commit; None for
        a row published without them (read it whole). See :mod:`mint_store.blocks`."""
        return None

    def direct(self, *, read: bool = False) -> Store | None:
        """An open store that any thread may call synchronously, or None (the default).

        The engine's switch path uses it instead of a trip through its I/O loop and an
        executor thread, which costs hundreds of microseconds against a few for an LMDB
        resolve. With ``read``, only a store whose rows are local files qualifies.
        """
        return None

    async def version(self, ref: str) -> VersionInfo:
        """Metadata of the version ``ref`` names (``tenant/name``, ``@N`` or ``:tag``)."""
        raise NotImplementedError

    async def versions(self, tenant: str, name: str) -> list[VersionInfo]:
        raise NotImplementedError

    async def names(self, tenant: str, *, prefix: str = "", after: str | None = None, limit: int = 1000) -> list[str]:
        raise NotImplementedError

    async def _layout(self, layout_id: str) -> Layout:
        raise NotImplementedError

    async def base(self, base: str) -> dict[str, list[int]]:
        raise NotImplementedError

    async def register_base(self, base: str, shapes: Mapping[str, Sequence[int]]) -> None:
        raise NotImplementedError

    async def bases(self) -> dict[str, int]:
        """Registered bases, by name, with their number of modules."""
        raise NotImplementedError

    async def tenants(self) -> list[str]:
        """Tenants with adapters (a store), or the tenants the token may read (a service)."""
        raise NotImplementedError

    async def publish(
        self, tenant: str, name: str, source: str | os.PathLike[str] | Adapter, *,
        base: str | None = None, tag: str | None = None,
    ) -> PublishResult:
        """Publish a PEFT directory or an :class:`Adapter` as the next version of tenant/name."""
        raise NotImplementedError

    async def tag(self, ref: str, tag: str) -> int:
        """Point ``tag`` at the version ``ref`` names; returns that version."""
        raise NotImplementedError

    async def untag(self, tenant: str, name: str, tag: str) -> None:
        raise NotImplementedError

    async def delete(self, ref: str) -> int:
        """Delete the version ``ref`` names; returns that version."""
        raise NotImplementedError

    async def events(self, after: int = 0, *, wait: float = 0.0, limit: int = 1000) -> EventBatch:
        """Events after ``after``; with ``wait``, block up to that many seconds for one."""
        raise NotImplementedError

    async def pull(self, ref: str, dest: str | os.PathLike[str]) -> Path:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` of ``ref`` into ``dest``."""
        raise NotImplementedError

    # -- shared logic ----------------------------------------------------------------------

    async def resolve_many(self, refs: Sequence[str]) -> list[Location | MintError]:
        """Refs -> locations, in batches of up to 10,000; a failed ref yields its error in place."""
        out: list[Location | MintError] = []
        step = self.config.resolve_batch
        for i in range(0, len(refs), step):
            out.extend(await self._resolve_batch(list(refs[i : i + step])))
        return out

    async def resolve(self, ref: str) -> Location:
        got = (await self._resolve_batch([ref]))[0]
        if isinstance(got, MintError):
            raise got
        return got

    async def read(self, ref: str | Location, out: Any = None) -> tuple[Location, Any]:
        """Resolve ``ref`` and read its row; re-resolve once if the location went stale."""
        if isinstance(ref, Location):
            return ref, await self.read_row(ref, out)
        loc = await self.resolve(ref)
        try:
            return loc, await self.read_row(loc, out)
        except (StaleLocation, BlobNotFound):
            loc = await self.resolve(ref)
            return loc, await self.read_row(loc, out)

    async def layout(self, layout_id: str) -> Layout:
        """The tensor table of a layout (cached: a layout id always names the same table)."""
        lay = self._layouts.get(layout_id)
        if lay is None:
            lay = self._layouts[layout_id] = await self._layout(layout_id)
        return lay

    async def load(self, ref: str) -> Adapter:
        """The adapter ``ref`` names, tensors as views of one freshly read row."""
        from mint_store.adapter import Adapter

        loc, row = await self.read(ref)
        config = None if ref.startswith("sha:") else (await self.version(ref)).peft_config
        return Adapter.from_row(await self.layout(loc.layout_id), row, peft_config=config)

    async def follow(self, after: int | None = None, *, wait: float = 30.0) -> AsyncGenerator[dict[str, Any]]:
        """Every event after ``after`` (default: from now on), forever. Rides out restarts."""
        if after is None:
            after = (await self.events(0, limit=0)).head
        delay = self.config.backoff
        while True:
            try:
                batch = await self.events(after, wait=wait)
            except (Unauthorized, Forbidden, BadRequest, InvalidName):
                raise  # a wrong token or argument: waiting does not fix it
            except (MintError, OSError) as e:  # a restart, a 5xx, a store error: the feed must go on
                if not isinstance(e, ConnectionFailed | ServiceUnavailable):
                    log.warning("change feed after seq %d failed (%r); retrying in %.2f s", after, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.max_backoff)
                continue
            delay = self.config.backoff
            for event in batch.events:
                yield event
            after = batch.last_seq


class SyncMintClient:
    """The same interface, blocking: an event loop runs in a daemon thread."""

    def __init__(self, url: str | os.PathLike[str], token: str | None = None, **options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mint-client", daemon=True)
        self._thread.start()
        self.client = MintClient(url, token, **options)

    def _call(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(_await(coro), self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> SyncMintClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def resolve(self, ref: str) -> Location:
        return self._call(self.client.resolve(ref))

    def resolve_many(self, refs: Sequence[str]) -> list[Location | MintError]:
        return self._call(self.client.resolve_many(refs))

    def read_row(self, loc: Location, out: Any = None, *, verify: bool = True) -> Any:
        return self._call(self.client.read_row(loc, out, verify=verify))

    def read(self, ref: str | Location, out: Any = None) -> tuple[Location, Any]:
        return self._call(self.client.read(ref, out))

    def version(self, ref: str) -> VersionInfo:
        return self._call(self.client.version(ref))

    def versions(self, tenant: str, name: str) -> list[VersionInfo]:
        return self._call(self.client.versions(tenant, name))

    def names(self, tenant: str, *, prefix: str = "", after: str | None = None, limit: int = 1000) -> list[str]:
        return self._call(self.client.names(tenant, prefix=prefix, after=after, limit=limit))

    def layout(self, layout_id: str) -> Layout:
        return self._call(self.client.layout(layout_id))

    def load(self, ref: str) -> Adapter:
        return self._call(self.client.load(ref))

    def base(self, base: str) -> dict[str, list[int]]:
        return self._call(self.client.base(base))

    def register_base(self, base: str, shapes: Mapping[str, Sequence[int]]) -> None:
        self._call(self.client.register_base(base, shapes))

    def bases(self) -> dict[str, int]:
        return self._call(self.client.bases())

    def tenants(self) -> list[str]:
        return self._call(self.client.tenants())

    def publish(
        self, tenant: str, name: str, source: str | os.PathLike[str] | Adapter, *,
        base: str | None = None, tag: str | None = None,
    ) -> PublishResult:
        return self._call(self.client.publish(tenant, name, source, base=base, tag=tag))

    def tag(self, ref: str, tag: str) -> int:
        return self._call(self.client.tag(ref, tag))

    def untag(self, tenant: str, name: str, tag: str) -> None:
        self._call(self.client.untag(tenant, name, tag))

    def delete(self, ref: str) -> int:
        return self._call(self.client.delete(ref))

    def pull(self, ref: str, dest: str | os.PathLike[str]) -> Path:
        return self._call(self.client.pull(ref, dest))

    def events(self, after: int = 0, *, wait: float = 0.0, limit: int = 1000) -> EventBatch:
        return self._call(self.client.events(after, wait=wait, limit=limit))

    def follow(self, after: int | None = None, *, wait: float = 30.0) -> Iterator[dict[str, Any]]:
        agen = self.client.follow(after, wait=wait)
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._call(agen.aclose())


async def _await(aw: Awaitable[T]) -> T:
    return await aw


__all__ = ["ClientConfig", "EventBatch", "MintClient", "SyncMintClient"]
