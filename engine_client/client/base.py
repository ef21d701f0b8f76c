"""The base of every ``MintClient`` transport: the interface, its shared logic, the factory.

``MintClient(url)`` builds the transport that ``url`` needs (:func:`client_class`): a
transport module subclasses :class:`MintClient` with ``transport="http"`` or
``transport="store"`` and so registers itself; :mod:`engine_client.client.mint_client` imports both, so
the package always has them. The transports import this module, never the other way round.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mint_store import Location, PublishResult, VersionInfo
from mint_store.errors import BlobNotFound, MintError, StaleLocation

from ..errors import (
    BadRequest,
    ConnectionFailed,
    Forbidden,
    IntegrityError,
    InvalidName,
    ServiceUnavailable,
    Unauthorized,
)

if TYPE_CHECKING:
    from mint_store.format.adapter import Adapter
    from mint_store.format.blocks import RowBlocks
    from mint_store.format.layout import Layout
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
    return VersionInfo.from_dict(d)


# transport name -> its class; filled by ``class X(MintClient, transport=...)``
_TRANSPORTS: dict[str, type[MintClient]] = {}


def client_class(url: str | os.PathLike[str]) -> type[MintClient]:
    """The transport for ``url``: HTTP for ``http(s)://``, a store opened in-process otherwise.

    Parameters
    ----------
    url
        A service URL (``http://``, ``https://``), a directory, ``file://`` or ``s3://``.

    Returns
    -------
    type[MintClient]
        The class whose instance ``MintClient(url)`` returns.
    """
    kind = "http" if os.fspath(url).startswith(("http://", "https://")) else "store"
    cls = _TRANSPORTS.get(kind)
    if cls is None:  # only if this module were loaded without its package
        raise RuntimeError(f"no {kind} transport registered; import engine_client first")
    return cls


class MintClient:
    """Async client of MinT Store: the service over HTTP, or a store opened in this process.

    ``MintClient(url)`` returns the transport ``url`` needs (:func:`client_class`), a
    subclass of this class; use it as ``async with MintClient(url) as client:`` or call
    :meth:`close`. Its calls run on the event loop that first uses it.

    Parameters
    ----------
    url
        ``http://`` or ``https://``: a ``mint serve`` service. Anything else (a directory,
        ``file://``, ``s3://``) is a store opened directly (read-only until the first write).
    token
        The bearer token for the service (ignored by a store opened directly).
    **options
        Fields of :class:`ClientConfig` (timeouts, retries, ``storage_options``, ``readonly``, ...).

    Raises
    ------
    ValueError
        An option out of range (:class:`ClientConfig` names it).
    TypeError
        An unknown option.
    """

    def __new__(cls, url: str | os.PathLike[str], token: str | None = None, **options: Any) -> MintClient:
        # ``MintClient(url)`` is the factory: it builds the transport that ``url`` needs
        return super().__new__(client_class(url) if cls is MintClient else cls)

    def __init_subclass__(cls, /, transport: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if transport is not None:  # a transport registers itself where it is defined
            _TRANSPORTS[transport] = cls

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
        """Read the row at ``loc`` into ``out`` (or a new uint8 array).

        Parameters
        ----------
        loc
            Where the row lies (from :meth:`resolve`).
        out
            A writable buffer of at least ``loc.length`` bytes, or None for a new array.
        verify
            Check the bytes against ``loc.content_id`` (the default; never skip it for
            bytes from a store you do not control).

        Returns
        -------
        Any
            ``out``, or the new ``numpy.uint8`` array, holding the row.

        Raises
        ------
        StaleLocation
            The row's shard was compacted away since ``loc`` was resolved: resolve again
            (:meth:`read` does).
        IntegrityError
            The bytes do not match their content id.
        ValueError
            ``out`` is read-only or too small.
        """
        raise NotImplementedError

    async def read_ranges(self, loc: Location, ranges: Sequence[tuple[int, int]], out: Any) -> int:
        """Read byte ranges ``(offset, nbytes)`` of ``loc``'s row into the same offsets of ``out`` (a
        row-sized writable buffer) in one vectored read; returns the bytes fetched. Unverified: the
        caller checks each block against :meth:`row_blocks` (see :mod:`mint_store.format.blocks`)."""
        raise NotImplementedError

    async def row_blocks(self, loc: Location) -> RowBlocks | None:
        """The block digests the writer recorded for ``loc``'s row, checked against its commit; None for
        a row published without them (read it whole). See :mod:`mint_store.format.blocks`."""
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
        """Publish a PEFT directory or an :class:`Adapter` as the next version of ``tenant/name``.

        Parameters
        ----------
        tenant, name
            Where the adapter lives (names of the grammar ``[a-z0-9][a-z0-9._-]{0,63}``).
        source
            A PEFT directory (``adapter_config.json`` and ``adapter_model.safetensors``) or
            an :class:`~mint_store.format.adapter.Adapter`.
        base
            The base model's MinT name, stamped on the adapter (None: ``unspecified``; a
            registered base checks the shapes).
        tag
            A tag to point at the new version.

        Returns
        -------
        PublishResult
            The new version, its content id and whether its bytes were deduplicated.

        Raises
        ------
        InvalidName
            A bad tenant, name, base or tag.
        InvalidAdapter, UnsupportedAdapter, BaseMismatch
            Files the store refuses (nothing is stored).
        Unauthorized, Forbidden
            Over HTTP: the token may not publish for ``tenant``.
        """
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
        """Where the row of the version ``ref`` names lies.

        Parameters
        ----------
        ref
            ``tenant/name`` (latest), ``tenant/name@N``, ``tenant/name:tag`` or ``sha:<content id>``.

        Returns
        -------
        Location
            Shard, offset, length, layout id and content id of the row.

        Raises
        ------
        NotFound
            No such adapter, version or tag (``AdapterNotFound``, ``VersionNotFound``, ``TagNotFound``).
        VersionDeleted
            The version was deleted.
        InvalidName
            ``ref`` is not a ref.
        """
        got = (await self._resolve_batch([ref]))[0]
        if isinstance(got, MintError):
            raise got
        return got

    async def read(self, ref: str | Location, out: Any = None) -> tuple[Location, Any]:
        """Resolve ``ref`` and read its row, verified; re-resolve once if the location went stale.

        Parameters
        ----------
        ref
            A ref (see :meth:`resolve`) or a :class:`Location` already resolved.
        out
            A writable buffer of at least the row's length, or None for a new uint8 array.

        Returns
        -------
        tuple
            ``(location, row)``.

        Raises
        ------
        NotFound, VersionDeleted, InvalidName
            As :meth:`resolve`.
        IntegrityError
            The row does not match its content id.
        """
        if isinstance(ref, Location):
            return ref, await self.read_row(ref, out)
        loc = await self.resolve(ref)
        try:
            return loc, await self.read_row(loc, out)
        except (StaleLocation, BlobNotFound):
            loc = await self.resolve(ref)
            return loc, await self.read_row(loc, out)

    async def layout(self, layout_id: str) -> Layout:
        """The tensor table of a layout (cached: a layout id always names the same table).

        The id is the hash of the table: a table that does not hash to it (a faulty service or
        cache answering another layout of the same row size) raises :class:`IntegrityError`,
        rather than mapping a row's bytes onto the wrong modules.
        """
        lay = self._layouts.get(layout_id)
        if lay is None:
            lay = await self._layout(layout_id)
            if lay.layout_id != layout_id:
                raise IntegrityError(f"layout {layout_id}: the table received hashes to {lay.layout_id}; "
                                     "the service or a cache in between answered another layout")
            self._layouts[layout_id] = lay
        return lay

    async def load(self, ref: str) -> Adapter:
        """The adapter ``ref`` names, tensors as views of one freshly read row.

        Parameters
        ----------
        ref
            A ref (see :meth:`resolve`).

        Returns
        -------
        Adapter
            Its base, LoRA modules (A, B, scaling) and PEFT config (None for a ``sha:`` ref).

        Raises
        ------
        NotFound, VersionDeleted, InvalidName, IntegrityError
            As :meth:`read`.
        """
        from mint_store.format.adapter import Adapter

        if ref.startswith("sha:"):
            loc, row = await self.read(ref)
            return Adapter.from_row(await self.layout(loc.layout_id), row)
        info = await self.version(ref)  # one resolve: a tag moved meanwhile must not pair two versions
        loc, row = await self.read(f"{info.tenant}/{info.name}@{info.version}")
        return Adapter.from_row(await self.layout(loc.layout_id), row, peft_config=info.peft_config)

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


__all__ = ["ClientConfig", "EventBatch", "MintClient", "client_class", "version_info"]
