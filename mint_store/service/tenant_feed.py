"""A tenant's own numbering of the change feed: seq ``n`` is the n-th event it can see.

The store's seq counts every tenant's commits: a tenant shown it (in a publish answer, or
as the seqs of its events, whose gaps are other tenants' commits) learned how busy the
others are. A tenant token is answered in its own numbering instead, on ``/v1/events``
(``seq``, ``after``, ``last_seq``, ``head``) and in the publish answer (``seq``). The
numbering is a pure function of the log and of the token's tenants (``feed.visible``), so
every server of the store (writer, replica, standby, after a restart) numbers alike, and a
client's cursor survives a failover. Admins (and a server without a token file) keep the
store's seqs.

Per tenant set the server keeps the store seqs of the events it sees, in order (8 bytes
each), built by one scan of the log at its first use and extended by the commits after it.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .auth import Principal
from .feed import visible

Events = Callable[..., list[dict[str, Any]]]  # Store.events(after, limit=)
_PAGE = 1000


class TenantSeqs:
    """One :class:`TenantTrack` per tenant set (visibility depends on the tenants alone), the
    least recently used dropped past ``capacity`` (rebuilt by a scan if it comes back)."""

    def __init__(self, capacity: int = 256) -> None:
        self._tracks: OrderedDict[frozenset[str], TenantTrack] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def track(self, who: Principal) -> TenantTrack:
        if who.is_admin:
            raise ValueError("admins are answered in the store's seqs")
        with self._lock:
            track = self._tracks.get(who.tenants)
            if track is None:
                track = self._tracks[who.tenants] = TenantTrack(who)
            self._tracks.move_to_end(who.tenants)
            while len(self._tracks) > self._capacity:
                self._tracks.popitem(last=False)
            return track


class TenantTrack:
    """The store seqs of the events one tenant set sees; its seq ``n`` is ``seqs[n - 1]``.
    Methods block (they read the index): call them on the executor."""

    def __init__(self, who: Principal) -> None:
        self._who = who
        self._seqs = array("q")
        self._checked = 0  # every event up to this store seq has been looked at
        self._lock = threading.Lock()

    def _catch_up(self, events: Events, upto: int) -> None:
        cursor = self._checked
        while cursor < upto:
            page = events(cursor, limit=_PAGE)
            if not page:
                break
            for ev in page:
                if visible(ev, self._who) is not None:
                    self._seqs.append(int(ev["seq"]))
            cursor = self._checked = int(page[-1]["seq"])  # per page: an error mid-scan loses nothing

    def page(self, events: Events, upto: int, after: int, limit: int) -> tuple[list[dict[str, Any]], int]:
        """``(events after the tenant's seq after, at most limit, renumbered; its head)``,
        having looked at the log up to store seq ``upto`` at least."""
        with self._lock:
            self._catch_up(events, upto)
            out = []
            for n in range(max(after, 0), min(after + limit, len(self._seqs))):
                got = events(self._seqs[n] - 1, limit=1)
                shown = visible(got[0], self._who) if got else None
                if shown is None:  # the index lost an event it had: never renumber around it
                    raise RuntimeError(f"the change feed's event {self._seqs[n]} is no longer in the index")
                out.append(shown | {"seq": n + 1})
            return out, len(self._seqs)

    def number_of(self, events: Events, seq: int) -> int:
        """The tenant's seq of the store's event ``seq`` (one it sees), or of the last it saw before."""
        with self._lock:
            self._catch_up(events, seq)
            return bisect_right(self._seqs, seq)
