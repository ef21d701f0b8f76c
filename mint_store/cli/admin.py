"""``mint compact | fsck | reindex | stats | sweep``: maintenance from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import InvalidName
from ..store import Store

FSCK_PROBLEMS_EXIT = 3
FSCK_HELD_EXIT = 4  # clean, but quarantined rows remain (versions that answer DamagedAdapter)


def _emit(args: argparse.Namespace, result: dict[str, Any], lines: list[tuple[str, Any]]) -> None:
    if args.json:
        print(json.dumps(result))
        return
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")


def _open(args: argparse.Namespace) -> Store:
    if args.server:
        raise InvalidName(
            f"`mint {args.command}` runs where the store is; for a live service use its admin routes "
            "(POST /v1/admin/compact, GET /v1/admin/stats) or stop it and run this with --store"
        )
    from ..errors import WriterLocked
    from ..fleet.replica import require_store

    require_store(args.store)  # an admin command never creates the store it was pointed at
    # stats only reads: it runs beside a live writer (fsck does not: a commit in flight
    # would look like an orphan or a log ahead of the index)
    if args.command == "stats":
        try:
            return Store.open(args.store, index_dir=args.index, readonly=True)
        except FileNotFoundError:  # no index here yet: the writer's open builds it
            pass
    try:
        return Store.open(args.store, index_dir=args.index)
    except WriterLocked as e:
        if e.url is None:
            raise
        raise WriterLocked(f"{e}. `mint {args.command}` runs on a store with no writer; while {e.url} serves "
                           f"it use its admin routes ({e.url}/v1/admin/compact, {e.url}/v1/admin/stats)",
                           holder=e.holder) from None


def run_admin(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "reindex":
        from ..config import default_index_dir
        from ..maintenance.reindex import rebuild_index
        from ..storage import open_storage

        if args.server:
            raise InvalidName("`mint reindex` runs where the store is, with no writer open")
        from ..fleet.replica import require_store

        require_store(args.store)
        storage = open_storage(args.store)
        index_dir = args.index or default_index_dir(str(getattr(storage, "root", storage.url)))
        r = rebuild_index(storage, index_dir)
        _emit(args, r.to_dict(), [("events", r.events), ("layouts", r.layouts), ("shards", r.shards),
                                  ("rows", r.blobs), ("index", index_dir)])
        return 0
    with _open(args) as store:
        if cmd == "stats":
            from ..maintenance.stats import store_stats

            s = store_stats(store)
            _emit(args, s, list(s.items()))
            return 0
        if cmd == "sweep":
            gone = store.sweep(grace_s=args.grace)
            _emit(args, {"deleted": gone}, [("shards deleted", len(gone))])
            return 0
        if cmd == "compact":
            from ..maintenance.compaction import CompactionPolicy, compact

            report = compact(store, CompactionPolicy(min_live_ratio=args.min_live),
                             progress=not args.no_progress and not args.json)
            out = report.to_dict()
            if args.grace is not None:
                out["swept"] = store.sweep(grace_s=args.grace)
            _emit(args, out, [
                ("shards before", report.shards_before), ("shards after", report.shards_after),
                ("rows moved", report.rows_moved), ("rows dropped (dead)", report.rows_dropped),
                ("bytes moved", f"{report.bytes_moved:,}"),
                ("bytes reclaimable at sweep", f"{report.bytes_reclaimable:,}"),
                ("damaged rows left in place", len(report.damaged)), ("time", f"{report.seconds:.2f} s"),
            ])
            return 0
        from ..maintenance.fsck import fsck

        fr = fsck(store, repair=args.repair, progress=not args.no_progress and not args.json)
        lines: list[tuple[str, Any]] = [("rows checked", fr.rows_checked), ("bytes checked", f"{fr.bytes_checked:,}")]
        for d in fr.damaged:
            lines.append(("damaged", f"{', '.join(d['adapters']) or d['content_id']}: {d['reason']} ({d['shard']})"))
        lines += [("orphan", k) for k in fr.orphans] + [("log", p) for p in fr.log_problems]
        lines += [("incomplete upload", f"{u['key']} (begun {u['age_s']:,.0f} s ago)") for u in fr.incomplete_uploads]
        lines += [("quarantined row", f"{', '.join(d['adapters']) or d['content_id']} ({d['shard']})") for d in fr.held]
        lines += [("note", n) for n in fr.notes]
        if args.repair:
            lines += [("quarantined", len(fr.quarantined)), ("orphans removed", len(fr.removed)),
                      ("uploads aborted", len(fr.aborted))]
        lines.append(("clean", fr.clean))
        _emit(args, fr.to_dict(), lines)
        if not fr.clean:
            print(f"mint: fsck found problems{'' if args.repair else '; run `mint fsck --repair`'}", file=sys.stderr)
            return FSCK_PROBLEMS_EXIT
        if fr.held:  # nothing fsck can repair: a person republishes the bytes or deletes the versions
            print(f"mint: {len(fr.held)} quarantined row(s): their versions answer DamagedAdapter until the same "
                  "adapter is published again (which heals them) or they are deleted (`mint rm`)", file=sys.stderr)
            return FSCK_HELD_EXIT
        return 0
