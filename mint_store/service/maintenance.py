"""The service's background maintenance of its store: compaction past the policy's thresholds,
the sweep of retired shards, and (less often: it lists the whole store) orphan shards."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

from ..store import Store
from .config import ServiceConfig

log = logging.getLogger("mint.service")
ORPHAN_SWEEP_S = 3600.0  # how often the background maintenance lists the store for orphan shards


async def auto_maintain(store: Store, config: ServiceConfig, executor: ThreadPoolExecutor) -> None:
    """Compaction past the policy's thresholds, the sweep of retired shards and, every
    ``ORPHAN_SWEEP_S``, the removal of orphan shards, in the background.

    Each compaction step is one writer operation, so publishes interleave with it.
    """
    from ..maintenance.compaction import CompactionPolicy, compact, plan
    from ..maintenance.fsck import orphan_shards

    loop = asyncio.get_running_loop()
    policy = CompactionPolicy(grace_s=config.compact_grace_s)
    # orphan shards (a commit that failed or was fenced after writing them) need a listing of the
    # whole store: not every pass, but at most every ORPHAN_SWEEP_S (and at the first pass)
    last_orphans = [-math.inf]

    def once() -> None:
        if plan(store, policy):
            report = compact(store, policy)
            log.info("auto-compaction moved %d rows, retired %d shards", report.rows_moved,
                     len(report.shards_retired))
        swept = store.sweep(grace_s=config.compact_grace_s)
        if swept:
            log.info("swept %d retired shards", len(swept))
        if time.monotonic() - last_orphans[0] >= ORPHAN_SWEEP_S:
            last_orphans[0] = time.monotonic()
            found = orphan_shards(store)
            removed = store.remove_orphans(found) if found else []
            if removed:
                log.info("removed %d orphan shard objects", len(removed))

    while True:
        await asyncio.sleep(config.compact_interval_s)
        try:
            await loop.run_in_executor(executor, once)
        except Exception:  # a storage error too: this task must outlive it
            log.exception("auto-compaction failed; retrying at the next interval")
