"""What callers put on the writer's queue and how their results come back.

A queue item is a bundle (a list of :class:`PendingPublish`, all or nothing), one
:class:`WriteOp`, or :data:`STOP`.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.layout import Layout
from ..results import PublishResult


class Sink:
    """Where the results of one caller's publish call go: one future for the whole bundle.

    A bundle is all or nothing: if any of its adapters is refused, none is committed.
    """

    __slots__ = ("future", "remaining", "results", "single")

    def __init__(self, n: int, *, single: bool) -> None:
        self.future: Future[Any] = Future()
        self.results: list[PublishResult | None] = [None] * n
        self.remaining = n
        self.single = single

    # The caller may cancel the future at any time (a request's deadline cancels the asyncio
    # future wrapping it), between the writer's done() check and its set_*: the writer must
    # not take the InvalidStateError for a failure of the commit (it failed the batch's other
    # sinks with store_unavailable, for commits that were durable)

    def fail(self, exc: BaseException) -> None:
        with contextlib.suppress(InvalidStateError):
            self.future.set_exception(exc)

    def ok(self, slot: int, result: PublishResult) -> None:
        self.results[slot] = result
        self.remaining -= 1
        if self.remaining == 0:
            with contextlib.suppress(InvalidStateError):
                self.future.set_result(self.results[0] if self.single else self.results)


@dataclass(slots=True)
class PendingPublish:
    tenant: str
    name: str
    layout: Layout
    row: np.ndarray
    cid: str
    tag: str | None
    peft_config: dict[str, Any] | None
    sink: Sink
    slot: int


@dataclass(slots=True)
class WriteOp:
    kind: str
    args: dict[str, Any]
    sink: Sink


MAINTENANCE_OPS = frozenset({"compact", "sweep", "quarantine", "remove_orphans"})


def fail_item(item: Any, err: BaseException) -> None:
    if isinstance(item, list):
        for p in item:
            p.sink.fail(err)
    elif isinstance(item, WriteOp):
        item.sink.fail(err)


STOP = object()
