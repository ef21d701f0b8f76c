"""Batches on a tensor-parallel engine: rank 0 decides, every rank loads, all fail together.

Rank 0 applies the staged hot swaps, resolves the batch's refs and broadcasts them with
their exact versions (``broadcast_object_list`` on the model's TP group, plain tuples); each
rank pins and loads its slices; one all-reduce of a flag then tells every rank whether any
failed, and only then are the reasons gathered (``all_gather_object``): a failure on any
rank fails the batch on every rank with one :class:`TPBatchFailed`. Per batch, one object
broadcast and one one-element all-reduce; none per layer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from mint_store import Location
from mint_store.errors import BlobNotFound, StaleLocation

from ..client.mint_client import MintClient
from ..device.pool_set import Held, PoolSet
from ..engine.lora_layers import BatchContext
from ..engine.metrics import Metrics
from ..engine.refs import RefTable
from ..errors import TPBatchFailed
from ..stream.streamer import Streamer
from .reads import ClientIO, RowIO, StoreIO
from .sharding import SlicedPool, TPModel

T = TypeVar("T")


class LoRAEngine(Protocol):
    """What a TP batch needs of its :class:`~engine_client.LoRAEngine` (which calls in here:
    this module must not import it back)."""

    client: MintClient
    device: torch.device
    metrics: Metrics
    streamer: Streamer
    _set: PoolSet
    _refs: RefTable

    def _resolve(self, refs: list[str]) -> dict[str, Location]: ...

    def _upload(self, locs: list[Location], held: Held | None) -> None: ...

    def call(self, aw: Awaitable[T]) -> T: ...


def prepare_batch(engine: LoRAEngine, tpm: TPModel, adapters: list[str | None], n: int,
                  problem: Exception | None = None) -> tuple[BatchContext, Held, list[str]]:
    """:meth:`LoRAEngine._prepare` on a TP engine: the same adapters and versions on every rank.
    ``problem``: what is wrong with this rank's adapter list (only rank 0's counts: it fails the
    batch on every rank through the broadcast)."""
    for attempt in (0, 1):
        decided, locs = _decide(engine, tpm, adapters, problem)
        held: Held = []
        lids: list[str] = []
        status: tuple[str, str] | None = None
        ctx = None
        if len(decided) != n:
            status = ("error", f"BatchMismatch: rank 0 ran a batch of {len(decided)} sequences, this rank {n}")
        else:
            try:
                lids = engine._set.acquire(locs)
                missing = engine._set.pin_resident(locs, held)
                if missing:
                    _upload(engine, missing, held)
                ctx = engine._set.context(decided, locs, n, held)
            except (StaleLocation, BlobNotFound) as e:
                status = ("stale", f"{type(e).__name__}: {e}")
            except Exception as e:  # reported to every rank below, raised there as one error
                status = ("error", f"{type(e).__name__}: {e}")
        # one small all-reduce says whether any rank failed; only then are the reasons gathered
        flag = torch.tensor([0 if status is None else 1], dtype=torch.int64, device=engine.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=tpm.group)
        if not int(flag.item()) and ctx is not None:
            return ctx, held, lids
        statuses: list[Any] = [None] * tpm.world
        dist.all_gather_object(statuses, status, group=tpm.group)
        failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
        engine._set.unwind(held, lids)
        if attempt == 0 and all(s[0] == "stale" for _, s in failed):
            if tpm.rank == 0:  # compacted away since rank 0 resolved: once more, fresh
                engine._refs.forget(list(locs))
            continue
        raise TPBatchFailed(
            "the batch failed to load on " + "; ".join(f"rank {r}: {s[1]}" for r, s in failed)
            + "; every rank dropped it (nothing ran)"
        )
    raise RuntimeError("unreachable")  # pragma: no cover


def _upload(engine: LoRAEngine, locs: list[Location], held: Held) -> None:
    """Rows this rank holds nowhere now: only its slice, by one vectored read, checked against
    the row's block digests (first load) or the slice digest (later loads); rows without block
    digests whole, through the streamer (checked against the content id), sliced on the copy."""
    io = _row_io(engine)
    whole = []
    for loc in locs:
        pool = engine._set.pools[loc.layout_id]
        reader = pool.reader if isinstance(pool, SlicedPool) else None
        got = None
        t0 = time.perf_counter()
        if (io is not None and reader is not None and isinstance(pool, SlicedPool)
                and not engine.streamer.cached(loc.content_id)):
            got = reader.read_slice(io, loc, pool)
        if got is None or not isinstance(pool, SlicedPool):
            whole.append(loc)
            continue
        sliced, nbytes = got
        engine.metrics.record("storage", nbytes, time.perf_counter() - t0)
        with engine._set.lock:
            slot = pool.slot_of(loc.content_id)
            if slot is None:
                slot = pool.assign(loc.content_id)
                try:
                    pool.load(slot, sliced, sliced=True)
                except BaseException:
                    pool.evict(loc.content_id)
                    raise
            pool.pin(slot)
            held.append((pool, slot))
    if whole:
        engine._upload(whole, held)


def _row_io(engine: LoRAEngine) -> RowIO | None:
    """A local store directly (no trip through the I/O loop), else the client if it reads ranges."""
    store = engine.client.direct(read=True)
    if store is not None:
        return StoreIO(store)
    if type(engine.client).read_ranges is MintClient.read_ranges:
        return None  # a client without ranged reads: rows whole
    return ClientIO(engine.call, engine.client)


def _decide(engine: LoRAEngine, tpm: TPModel, adapters: list[str | None],
            problem: Exception | None = None) -> tuple[list[str | None], dict[str, Location]]:
    """Rank 0's adapters and their locations, broadcast to every rank of the group."""
    msg: list[Any] = [None]
    if tpm.rank == 0 and problem is not None:
        msg[0] = ("error", f"{type(problem).__name__}: {problem}", None)
    elif tpm.rank == 0:
        try:
            engine._refs.apply_staged()  # hot swaps land here, between batches, for every rank at once
            refs = list(dict.fromkeys(a for a in adapters if a is not None))
            locs = engine._resolve(refs)
            # plain tuples (the object collective pickles; keep it to builtins)
            msg[0] = ("ok", list(adapters), {r: dataclasses.astuple(loc) for r, loc in locs.items()})
        except Exception as e:  # every rank must hear of it, or the others wait in the broadcast
            msg[0] = ("error", f"{type(e).__name__}: {e}", None)
    dist.broadcast_object_list(msg, src=tpm.src, group=tpm.group)
    kind, what, locs_t = msg[0]
    if kind != "ok":
        raise TPBatchFailed(f"rank 0 could not resolve the batch: {what}; every rank dropped it (nothing ran)")
    return list(what), {r: Location(*t) for r, t in locs_t.items()}
