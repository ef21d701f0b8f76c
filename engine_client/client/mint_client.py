"""``MintClient``: one async interface over the HTTP service or a store opened directly.

    client = MintClient("http://127.0.0.1:8470", token="...")   # the service
    client = MintClient("/data/mint")                           # a directory, file:// or s3://
    loc, row = await client.read("acme/chat:prod")              # verified against its content id

``MintClient(url)`` returns the right implementation for the URL (the base class and the
factory are in :mod:`engine_client.client.base`; the transports in :mod:`.http_transport` and :mod:`.local_transport`).
``SyncMintClient`` is the same interface for code without an event loop (it runs one in a
thread).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

from ..stream.io_loop import awaited
from .base import ClientConfig, EventBatch, MintClient, client_class
from .http_transport import HttpMintClient
from .local_transport import StoreMintClient

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


def _blocking(
    fn: Callable[Concatenate[MintClient, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[SyncMintClient, P], R]:
    """The blocking twin of the async method ``fn``: same name, signature and docstring."""
    name = fn.__name__

    @functools.wraps(fn)
    def method(self: SyncMintClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        # the method of the transport this client built, not the base's abstract one
        got: R = self.call(getattr(self.client, name)(*args, **kwargs))
        return got

    return method


class SyncMintClient:
    """The same interface, blocking: an event loop runs in a daemon thread."""

    def __init__(self, url: str | os.PathLike[str], token: str | None = None, **options: Any) -> None:
        self.client = MintClient(url, token, **options)  # first: bad options start no thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mint-client", daemon=True)
        self._thread.start()

    def call(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` (built from ``self.client``'s async methods, e.g. several under
        ``asyncio.gather``: one hop to the loop for all of them) to its end; its result."""
        return asyncio.run_coroutine_threadsafe(awaited(coro), self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self.call(self.client.close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> SyncMintClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # every call below is the async method of the same name, run to its end on the loop
    resolve = _blocking(MintClient.resolve)
    resolve_many = _blocking(MintClient.resolve_many)
    read_row = _blocking(MintClient.read_row)
    read = _blocking(MintClient.read)
    version = _blocking(MintClient.version)
    versions = _blocking(MintClient.versions)
    names = _blocking(MintClient.names)
    layout = _blocking(MintClient.layout)
    load = _blocking(MintClient.load)
    base = _blocking(MintClient.base)
    register_base = _blocking(MintClient.register_base)
    bases = _blocking(MintClient.bases)
    tenants = _blocking(MintClient.tenants)
    publish = _blocking(MintClient.publish)
    tag = _blocking(MintClient.tag)
    untag = _blocking(MintClient.untag)
    delete = _blocking(MintClient.delete)
    pull = _blocking(MintClient.pull)
    events = _blocking(MintClient.events)
    read_ranges = _blocking(MintClient.read_ranges)
    row_blocks = _blocking(MintClient.row_blocks)

    def follow(self, after: int | None = None, *, wait: float = 30.0) -> Iterator[dict[str, Any]]:
        agen = self.client.follow(after, wait=wait)
        try:
            while True:
                try:
                    yield self.call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self.call(agen.aclose())


__all__ = [
    "ClientConfig", "EventBatch", "HttpMintClient", "MintClient", "StoreMintClient", "SyncMintClient", "client_class",
]
