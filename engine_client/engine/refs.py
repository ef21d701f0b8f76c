"""The engine's ref -> location table, and hot swaps staged between batches.

``tenant/name@7`` and ``sha:<id>`` name one row forever and are cached. ``tenant/name``
(latest) and ``tenant/name:tag`` move: without the event feed they are resolved again
for every batch; an engine following the feed caches them and re-resolves exactly the
refs an event touches. Such an update is *staged* and applied when the next batch
starts, so a batch that is already running finishes on the version it started with.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from mint_store import Location
from mint_store.format.names import Ref, parse_ref_cached


class RefTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: dict[str, Location] = {}
        self._staged: dict[str, Location | None] = {}  # None: forget, resolve at next use
        self.following = False
        self.swaps = 0  # staged updates applied so far
        # bumped when the follower starts on an event: a resolution that began before it may
        # predate the change and is not cached (the event could not see it to re-resolve it)
        self.epoch = 0

    @staticmethod
    def _ref(ref: str) -> Ref:
        return parse_ref_cached(ref)

    def mutable(self, ref: str) -> bool:
        r = self._ref(ref)
        return r.content_id is None and r.version is None

    def get(self, ref: str) -> Location | None:
        return self._current.get(ref)

    def put(self, ref: str, loc: Location, epoch: int | None = None) -> None:
        """Remember a resolution that started at ``epoch`` (mutable refs only while following)."""
        mutable = self.mutable(ref)
        with self._lock:
            if mutable and not self.following:
                return
            if mutable and epoch is not None and epoch != self.epoch:
                return  # an event arrived meanwhile (or following stopped): resolve again at the next use
            self._current[ref] = loc

    def start_following(self) -> None:
        """Cache moving refs from now on; a resolution that began before is not cached (it may
        predate an event the follower starts after)."""
        with self._lock:
            self.following = True
            self.epoch += 1

    def begin_event(self) -> None:
        with self._lock:
            self.epoch += 1

    def stage(self, ref: str, loc: Location | None) -> None:
        with self._lock:
            if self.following:  # (an event still in flight when following stopped: dropped)
                self._staged[ref] = loc

    def stop_following(self) -> None:
        """Forget every cached and staged location: nothing would keep the moving refs fresh
        any more, and a staged one applied later would pin its ref to that version for good."""
        with self._lock:
            self.following = False
            self.epoch += 1  # a resolution begun before is not cached by a later start either
            self._current.clear()
            self._staged.clear()

    def apply_staged(self) -> list[str]:
        """Make staged updates current (called when a batch starts); returns the refs changed."""
        with self._lock:
            staged, self._staged = self._staged, {}
            for ref, loc in staged.items():
                if loc is None:
                    self._current.pop(ref, None)
                else:
                    self._current[ref] = loc
            self.swaps += len(staged)
        return list(staged)

    def forget(self, refs: Iterable[str] | None = None) -> None:
        with self._lock:
            if refs is None:
                self._current.clear()
            else:
                for r in refs:
                    self._current.pop(r, None)

    def affected(self, event: dict[str, Any]) -> list[str]:
        """The cached refs that ``event`` (a change-feed entry) may have moved."""
        kind = event.get("kind")
        with self._lock:
            cached = list(self._current.items())
        if kind in ("compact", "quarantine"):  # rows moved to another shard, or set aside as damaged
            moved = set(event.get("content_ids", ()))
            return [ref for ref, loc in cached if loc.content_id in moved]
        if kind == "publish":
            changes = [(i["tenant"], i["name"], None, i.get("tag")) for i in event.get("items", ())]
        elif kind in ("tag", "untag"):
            changes = [(event["tenant"], event["name"], None, event["tag"])]
        elif kind == "delete":
            changes = [(event["tenant"], event["name"], event["version"], "*")]
        else:
            return []
        out = []
        for ref, _ in cached:
            r = self._ref(ref)
            if r.content_id is not None:
                continue
            for tenant, name, version, tag in changes:
                if (r.tenant, r.name) != (tenant, name):
                    continue
                hit = (
                    (kind == "publish" and r.version is None and (r.tag is None or r.tag == tag))
                    or (kind in ("tag", "untag") and r.tag == tag)
                    or (kind == "delete" and (r.version == version or r.version is None))
                )
                if hit:
                    out.append(ref)
                    break
        return out
