"""The client over a store opened in this process (a directory, ``file://`` or ``s3://``).

Every blocking store call runs on the client's own bounded thread pool, except for the
engine's switch path, which calls the open store directly (:meth:`StoreMintClient.direct`).

The store opens read-only (beside a running ``mint serve`` or another writer, following
its commits), and takes the store's writer lease at the first write: ``writable=True``
takes it at once, ``readonly=True`` never. Clients of one store in one process share
one writer.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mint_store import Location, PublishResult, VersionInfo
from mint_store.errors import MintError
from mint_store.format.blocks import RowBlocks
from mint_store.read.buffers import row_buffer
from mint_store.read.vread import read_row_ranges, row_block_digests

from .base import EventBatch, MintClient

if TYPE_CHECKING:
    from mint_store.format.adapter import Adapter
    from mint_store.format.layout import Layout
    from mint_store.store import Store

T = TypeVar("T")

# (store URL, index directory) -> the writable Store that this process's clients share
_WRITERS: dict[tuple[str, str], Store] = {}
_WRITERS_LOCK = threading.Lock()


def _shared_writer(store: Store) -> Store:
    """A writable Store for ``store``'s data: one another client here holds, or ``store``
    itself, upgraded (raises WriterLocked naming the holder when another process writes)."""
    key = (store.storage.url, os.path.realpath(store.index_dir))
    with _WRITERS_LOCK:
        held = _WRITERS.get(key)
        if held is not None and held.writable and not held.closed:
            return held
        store.make_writable()
        _WRITERS[key] = store
        return store


def _forget_writer(store: Store) -> None:
    with _WRITERS_LOCK:
        key = (store.storage.url, os.path.realpath(store.index_dir))
        if _WRITERS.get(key) is store:
            del _WRITERS[key]


class StoreMintClient(MintClient, transport="store"):
    def __init__(self, url: str | os.PathLike[str], token: str | None = None, **options: Any) -> None:
        super().__init__(url, token, **options)
        self._store: Store | None = None
        self._writer: Store | None = None
        self._executor = ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="mint-client")
        self._commits: asyncio.Event | None = None
        self._listening: Store | None = None  # the writable store whose commits set _commits
        self._local_rows = False  # the open store's rows are local files (direct reads)

    async def _run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def store(self) -> Store:
        """The store, opened on first use (off the event loop: opening may replay the log)."""
        if self._store is None:
            from mint_store.store import Store

            c = self.config
            opts = dict(c.storage_options) if c.storage_options else None
            store = await self._run(self._open, Store, index_dir=c.index_dir, storage_options=opts)
            if self._store is not None:  # another task opened it meanwhile
                await self._run(store.close)
            else:
                from mint_store.storage import LocalStorage

                self._local_rows = isinstance(store.storage, LocalStorage)
                self._store = store
                self._listen(store)
        return self._store

    def _open(self, store_cls: type[Store], **opts: Any) -> Store:
        c = self.config
        if c.writable and not c.readonly:
            return store_cls.open(self.url, **opts)
        try:
            return store_cls.open(self.url, readonly=True, **opts)
        except FileNotFoundError:
            if c.readonly:
                raise
            return store_cls.open(self.url, **opts)  # no index here yet: the writer builds it

    async def writer(self) -> Store:
        """The store for writes: the writer lease is taken here, at the first write."""
        w = self._writer
        if w is not None and not w.closed:
            return w
        s = await self.store()
        if self.config.readonly:
            from mint_store.errors import ReadOnlyStore

            raise ReadOnlyStore("this client was opened with readonly=True; open one without it to write")
        w = await self._run(_shared_writer, s)
        if self._listening is not w:  # (another client's store, closed since, told of no commit of w's)
            self._listen(w)
        self._writer = w
        return w

    def _listen(self, store: Store) -> None:
        # a store written in this process wakes followers at once; others are polled
        if store.writable:
            loop = asyncio.get_running_loop()
            self._commits = asyncio.Event()
            commits = self._commits

            def on_commit(seq: int) -> None:  # on the writer thread
                try:
                    loop.call_soon_threadsafe(commits.set)
                except RuntimeError:  # this client's loop is gone; the writer it shared lives on
                    pass

            store.add_commit_listener(on_commit)
            self._listening = store

    async def close(self) -> None:
        self._writer = None
        if self._store is not None:
            store, self._store = self._store, None
            _forget_writer(store)
            await self._run(store.close)
        self._executor.shutdown(wait=True)

    async def _resolve_batch(self, refs: Sequence[str]) -> list[Location | MintError]:
        s = await self.store()
        return await self._run(s.resolve_many, list(refs))

    async def read_row(self, loc: Location, out: Any = None, *, verify: bool = True) -> Any:
        out, view = row_buffer(loc.length, out)
        s = await self.store()
        await self._run(s.read_row, loc, view, verify=verify)
        return out

    async def read_ranges(self, loc: Location, ranges: Sequence[tuple[int, int]], out: Any) -> int:
        s = await self.store()
        return await self._run(read_row_ranges, s, loc, ranges, out)

    async def row_blocks(self, loc: Location) -> RowBlocks | None:
        s = await self.store()
        return await self._run(row_block_digests, s, loc)

    def direct(self, *, read: bool = False) -> Store | None:
        # opened by the first async call; a store is thread-safe for resolves and reads. Rows on
        # an object store stay on the executor, where many reads overlap their round trips.
        s = self._store
        if s is None or (read and not self._local_rows):
            return None
        return s

    async def version(self, ref: str) -> VersionInfo:
        s = await self.store()
        return await self._run(s.version, ref)

    async def versions(self, tenant: str, name: str) -> list[VersionInfo]:
        s = await self.store()
        return await self._run(s.versions, tenant, name)

    async def names(self, tenant: str, *, prefix: str = "", after: str | None = None, limit: int = 1000) -> list[str]:
        s = await self.store()
        return await self._run(s.names, tenant, prefix=prefix, after=after, limit=limit)

    async def _layout(self, layout_id: str) -> Layout:
        s = await self.store()
        return await self._run(s.layout, layout_id)

    async def base(self, base: str) -> dict[str, list[int]]:
        s = await self.store()
        return await self._run(s.base, base)

    async def register_base(self, base: str, shapes: Mapping[str, Sequence[int]]) -> None:
        s = await self.writer()
        await self._run(s.register_base, base, {k: list(v) for k, v in shapes.items()})

    async def bases(self) -> dict[str, int]:
        s = await self.store()
        return await self._run(s.bases)

    async def tenants(self) -> list[str]:
        s = await self.store()
        return await self._run(s.tenants)

    async def publish(
        self, tenant: str, name: str, source: str | os.PathLike[str] | Adapter, *,
        base: str | None = None, tag: str | None = None,
    ) -> PublishResult:
        s = await self.writer()
        if isinstance(source, str | os.PathLike):
            from mint_store.format.adapter import UNSPECIFIED_BASE
            from mint_store.peft.directory import load_peft_dir

            source = await self._run(load_peft_dir, source, base=base or UNSPECIFIED_BASE,
                                     limits=s.config.limits)
        elif base is not None and base != source.base:
            from mint_store.format.adapter import Adapter

            source = Adapter(base, source.modules, source.peft_config)
        fut = await self._run(s.publish_async, tenant, name, source, tag=tag)
        return await asyncio.wrap_future(fut)

    async def tag(self, ref: str, tag: str) -> int:
        s = await self.writer()
        return await self._run(s.tag, ref, tag)

    async def untag(self, tenant: str, name: str, tag: str) -> None:
        s = await self.writer()
        await self._run(s.untag, tenant, name, tag)

    async def delete(self, ref: str) -> int:
        s = await self.writer()
        return await self._run(s.delete, ref)

    async def events(self, after: int = 0, *, wait: float = 0.0, limit: int = 1000) -> EventBatch:
        s = await self.store()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            # woken by the commits of a writer in this process; polled once it is closed
            listening = self._listening
            commits = self._commits if listening is not None and not listening.closed else None
            if commits is not None:
                commits.clear()
            scanned = await self._run(s.events, after, limit=limit) if limit else []
            left = deadline - loop.time()
            if scanned or left <= 0:
                head = await self._run(lambda: s.last_seq)
                last = int(scanned[-1]["seq"]) if scanned else after
                return EventBatch(tuple(scanned), last, max(head, last))
            if commits is not None:
                try:
                    await asyncio.wait_for(commits.wait(), left)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(min(self.config.poll_interval, left))

    async def pull(self, ref: str, dest: str | os.PathLike[str]) -> Path:
        from mint_store.peft.directory import save_peft_dir

        adapter = await self.load(ref)
        return await self._run(save_peft_dir, adapter, dest)
