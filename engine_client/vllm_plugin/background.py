"""One thread at the lowest priority running a worker's chores in order, off the loads' path.

vLLM pins its CPU worker to its own CPUs, and every thread of the worker inherits that: work
done beside a load (a spare buffer faulted in, a row written to the row cache) competes with
vLLM's steps for those CPUs. At nice 19 (Linux: a thread's own priority) it waits for them. One
thread for the worker's life, fed by a queue: a thread started per chore cost a load up to
47 ms in ``tools/bench_vllm.py`` (``Thread.start`` waits until the new thread runs, and on
vLLM's one pinned CPU it waits behind whatever holds that CPU and the GIL). A forked child
starts its own thread (the parent's is not in it, nor are the parent's queued chores).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("vllm.plugins.mint_lora_resolver.background")


class NiceWorker:
    """Runs the callables given to :meth:`submit`, one after another, on one thread at nice 19."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Callable[[], None]] | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` after those submitted before it (an exception it raises is logged)."""
        with self._lock:
            if self._queue is None or self._pid != os.getpid():
                self._queue, self._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(target=_run, args=(self._queue,), name=self.name, daemon=True).start()
            self._queue.put(job)

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until every job submitted so far has run (tests); False on timeout."""
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout)


def _run(jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    while True:
        job = jobs.get()
        try:
            job()
        except Exception:  # a chore that failed costs what it would have made, never the worker
            log.warning("background chore failed", exc_info=True)
        del job  # (what it held, a row buffer included, goes back now)
