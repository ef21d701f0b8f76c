"""The engine's I/O thread: one event loop that drives the client and the streamer.

The engine's forward is synchronous (it may even be called from inside someone else's
event loop), while the client and the streamer are async and loop-confined; they all
live on this loop, and the engine hands them coroutines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class IOThread:
    def __init__(self, name: str = "mint-engine-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def in_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for it (from any other thread)."""
        if self.in_thread():
            coro.close()
            raise RuntimeError("blocking on the engine's I/O loop from inside it would deadlock")
        return self.submit(coro).result()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self, final: Coroutine[Any, Any, Any] | None = None) -> None:
        """Run ``final`` (e.g. closing the client), cancel what is left, stop the loop."""
        if self.loop.is_closed():
            if final is not None:
                final.close()
            return

        async def shutdown() -> None:
            try:
                if final is not None:
                    await final
            finally:
                me = asyncio.current_task()
                rest = [t for t in asyncio.all_tasks() if t is not me]
                for t in rest:
                    t.cancel()
                await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.run(shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()


async def awaited(aw: Awaitable[T]) -> T:
    """``aw`` as a coroutine (``run_coroutine_threadsafe`` takes nothing else)."""
    return await aw
