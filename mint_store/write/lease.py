"""The store's writer lease: one writer per store, whatever its index directory or machine.

``writer.lease`` lives in the store itself (a local directory, S3, or memory://: the backends with
conditional writes; on others a writer is refused)::

    {"format": 1, "epoch": 7, "expires": 1767225600.0, "released": false,
     "holder": {"id": "...", "host": "...", "pid": 123, "start": "...", "url": "http://..."}}

- acquired with a create-only write when absent; taken over, after it expired or was
  released, with compare-and-swap (S3: ``If-Match`` on the ETag; local disk: a create-only
  link of the next version, no lock held, see storage/local_cas.py). Each take-over raises ``epoch`` by one, so
  epochs strictly increase across writers (the object is never deleted, only released);
- renewed by a background thread every ``renew_s`` for ``ttl_s`` more seconds (``ttl`` is in
  the record, so that a contender with a shorter TTL still waits the holder's);
- expired only by the contender's own monotonic clock, never by comparing ``expires`` with
  its wall clock: one version of the object (its token) must stay unrenewed for the TTL
  while the contender watches it (:class:`LeaseWatch`). Each renewal writes a new version,
  so clocks that disagree (a standby running seconds ahead took a healthy writer's lease)
  cannot shorten the wait, and the holder, which stops committing 0.8 TTL after its last
  renewal began, has stopped before. ``expires`` only tells a plain open whether waiting
  is worth it (past: watch the lease for a TTL; ahead: refuse at once);
- a holder on this host (same boot, same pid namespace) whose process is gone is taken over at
  once (no TTL wait);
- released on close (``released: true``), so the next open is immediate.

The writer checks :meth:`WriterLease.check` before each commit; whatever slips past that
check is stopped by the create-only log object, so a commit is never half-visible.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..errors import BlobNotFound, ObjectChanged, ObjectExists, StoreUnavailable, WriterFenced, WriterLocked
from ..storage import Storage

LEASE_KEY = "writer.lease"
LEASE_FORMAT = 1
log = logging.getLogger(__name__)


def _proc_stat(pid: int) -> list[bytes]:
    """Fields of /proc/<pid>/stat after the command name ([0] state, [19] start time)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _proc_start(pid: int) -> str | None:
    """The process's start time (tells a live pid from a reused one), where /proc has it."""
    fields = _proc_stat(pid)
    return fields[19].decode() if len(fields) > 19 else None


def _namespace() -> dict[str, str | None]:
    """What a pid means here: this boot of the kernel and this pid namespace. Containers with the
    host's network share its host name, not its pids: a writer's pid missing from ours says nothing."""
    out: dict[str, str | None] = {"boot": None, "pidns": None}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            out["boot"] = f.read().strip()
        out["pidns"] = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pass
    return out


def _gone(holder: dict[str, Any]) -> bool:
    """True when the holder ran on this host, in this boot and pid namespace, and its process no
    longer exists. Anything unknown is not gone: the lease then runs out instead."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    here = _namespace()
    if here["boot"] is None or any(holder.get(k) != v for k, v in here.items()):
        return False
    pid = int(holder["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    fields = _proc_stat(pid)
    if fields[:1] in ([b"Z"], [b"X"]):  # killed, not yet reaped by its parent
        return True
    start = holder.get("start")
    return start is not None and len(fields) > 19 and fields[19].decode() != start


def describe(holder: dict[str, Any]) -> str:
    where = f"pid {holder.get('pid')} on {holder.get('host')}"
    return f"{where}, serving {holder['url']}" if holder.get("url") else where


class LeaseWatch:
    """How long one version of ``writer.lease`` has stayed unrenewed, by this process's
    monotonic clock since it first saw that version (no wall clock involved: see the module
    docstring). Kept across take-over attempts: a standby's polls each add to what it saw."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: tuple[str, bytes] | None = None
        self._since = 0.0

    def unrenewed_for(self, token: str, raw: bytes) -> float:
        """Seconds this version (``token``, its bytes) has been seen unchanged; 0 when it is new."""
        now = self._clock()
        if self._seen != (token, raw):
            self._seen, self._since = (token, raw), now
        return now - self._since


class WriterLease:
    """Holds ``writer.lease`` of one store while a writable Store is open.

    ``watch`` carries what earlier attempts saw of the lease (a standby passes the same one at
    each poll); ``wall_clock`` is only used for the ``expires`` written and shown.
    """

    def __init__(self, storage: Storage, *, ttl_s: float = 10.0, renew_s: float = 3.0,
                 watch: LeaseWatch | None = None, wall_clock: Callable[[], float] = time.time) -> None:
        if not 0 < renew_s < ttl_s:
            raise ValueError("the lease renew interval must be positive and shorter than its TTL")
        self.storage = storage
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        self.watch = watch if watch is not None else LeaseWatch()
        self._wall = wall_clock
        self.epoch = 0
        self.lost: str | None = None  # why this writer was fenced
        self._holder: dict[str, Any] = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                        "start": _proc_start(os.getpid()), "url": None, **_namespace()}
        self._token = ""
        self._valid_until = 0.0  # monotonic: after this we may no longer be the writer
        self._mutex = threading.RLock()  # one renewal/CAS at a time (re-entered by the renew loop)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str | None:
        url = self._holder.get("url")
        return str(url) if url else None

    def _record(self, *, expires: float, released: bool = False) -> bytes:
        return json.dumps({"format": LEASE_FORMAT, "epoch": self.epoch, "expires": expires, "ttl": self.ttl_s,
                           "released": released, "holder": self._holder}).encode()

    def _read(self) -> tuple[dict[str, Any], str, bytes] | None:
        try:
            raw, token = self.storage.get_with_token(LEASE_KEY)
        except BlobNotFound:
            return None
        try:
            rec = json.loads(raw)
            if not isinstance(rec, dict):
                raise ValueError("not an object")
        except ValueError:  # a torn or foreign record holds nothing; its epoch is unknown
            rec = {"epoch": 0, "expires": 0, "holder": {}}
        return rec, token, raw

    def _ttl_of(self, rec: dict[str, Any]) -> float:
        """The TTL to wait out: the holder's (in its record) when longer than ours."""
        try:
            theirs = float(rec.get("ttl", 0))
        except (TypeError, ValueError):
            theirs = 0.0
        # NaN (not even equal to itself) is ours; a day at most, so a foreign value cannot pin the lease
        return min(max(self.ttl_s, theirs), 86400.0) if theirs == theirs else self.ttl_s

    def _free(self, rec: dict[str, Any], token: str, raw: bytes) -> bool:
        """Whether the lease may be taken now: released, its holder gone from this host, or this
        version seen unrenewed for a whole TTL on our monotonic clock."""
        if rec.get("released") or _gone(rec.get("holder") or {}):
            return True
        return self.watch.unrenewed_for(token, raw) >= self._ttl_of(rec)

    # -- acquire / renew / release --------------------------------------------------------

    def acquire(self, *, wait: bool = True) -> None:
        """Take the lease or raise WriterLocked naming the holder; starts the renew thread.

        A lease held by a live-looking record is refused at once. With ``wait``, one whose
        ``expires`` has passed is watched until it has stayed unrenewed for the TTL (taken) or
        changes (refused): an open after a writer elsewhere died waits up to one TTL. Without it
        (a standby, polling) a lease not yet seen unrenewed for the TTL is refused at once; the
        next attempt with the same :attr:`watch` goes on from what this one saw.
        """
        first: str | None = None  # the version this call first saw: a new one means the holder lives
        for _ in range(8):  # a lost race re-reads the lease: someone else may now hold it
            started = time.monotonic()
            current = self._read()
            while current is not None and not self._free(*current):
                rec, token, _ = current
                first = token if first is None else first
                if not wait or token != first or float(rec.get("expires", 0)) > self._wall():
                    raise WriterLocked(_locked_message(self.storage.url, rec, self._wall()),
                                       holder=rec.get("holder") or {})
                time.sleep(min(self.renew_s, self._ttl_of(rec) / 4))
                started = time.monotonic()
                current = self._read()
            if current is None:
                self.epoch = 1
                data = self._record(expires=self._wall() + self.ttl_s)
                try:
                    self.storage.create(LEASE_KEY, data)
                except ObjectExists:
                    continue
            else:
                rec, token, _ = current
                self.epoch = int(rec.get("epoch", 0)) + 1
                data = self._record(expires=self._wall() + self.ttl_s)
                try:
                    self.storage.replace_if(LEASE_KEY, data, token)
                except ObjectChanged:
                    continue
            self._token = self._read_token(data)
            self._valid_until = started + 0.8 * self.ttl_s  # a margin for clock rates
            self._thread = threading.Thread(target=self._renew_loop, name="mint-lease", daemon=True)
            self._thread.start()
            return
        raise WriterLocked(f"store {self.storage.url}: the writer lease keeps changing hands; try again")

    def _read_token(self, written: bytes) -> str:
        raw, token = self.storage.get_with_token(LEASE_KEY)
        if raw != written:
            raise WriterFenced(f"store {self.storage.url}: the writer lease was taken as it was acquired")
        return token

    def renew(self) -> None:
        """Push the expiry out by ``ttl_s``; raise WriterFenced if the lease is no longer ours."""
        with self._mutex:
            if self.lost is not None:
                raise WriterFenced(self.lost)
            started = time.monotonic()
            current = self._read()
            rec = current[0] if current else {}
            if current is None or rec.get("epoch") != self.epoch or (rec.get("holder") or {}).get("id") != \
                    self._holder["id"] or rec.get("released"):
                holder = (rec.get("holder") or {}) if current else {}
                self.lost = (f"this writer (epoch {self.epoch}) lost the lease of {self.storage.url} to "
                             f"{describe(holder) if holder else 'nobody'} (epoch {rec.get('epoch')}); nothing "
                             "more is committed: reopen the store")
                raise WriterFenced(self.lost)
            data = self._record(expires=self._wall() + self.ttl_s)
            try:
                self.storage.replace_if(LEASE_KEY, data, current[1])
                # taken between our write and this read-back: lost too (else the renew thread
                # stopped without saying so, and this writer believed itself valid until its deadline)
                self._token = self._read_token(data)
            except (ObjectChanged, WriterFenced):
                self.lost = f"this writer (epoch {self.epoch}) lost the lease of {self.storage.url}; reopen the store"
                raise WriterFenced(self.lost) from None
            self._valid_until = started + 0.8 * self.ttl_s  # a margin for clock rates

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                with self._mutex:  # (stop_renewing takes it after setting _stop: a tick past it renews nothing)
                    if self._stop.is_set():
                        return
                    self.renew()
            except WriterFenced:
                log.error("%s", self.lost)
                return
            except Exception:  # a storage hiccup: the next tick tries again; check() fences in time
                log.warning("could not renew the writer lease of %s", self.storage.url, exc_info=True)

    def check(self) -> None:
        """Raise unless this writer certainly still holds the lease: WriterFenced when it lost it,
        StoreUnavailable when it cannot tell (the storage does not answer).

        Past its local deadline (renewals failed for a whole TTL) it renews once first. A renewal
        that fails on the storage is not a loss: the writer recovers in place and, once the storage
        answers, either renews (nobody took over) or learns it was fenced. Taken for a loss, it
        stopped the writer while the renew thread went on holding the lease, and no standby could
        take over.
        """
        if self.lost is not None:
            raise WriterFenced(self.lost)
        if time.monotonic() >= self._valid_until:
            try:
                self.renew()
            except WriterFenced:
                raise
            except Exception as e:
                raise StoreUnavailable(f"this writer could not renew its lease of {self.storage.url} ({e!r}); "
                                       "nothing was committed; it retries by itself") from e

    def stop_renewing(self) -> None:
        """Renew no more (the writer thread ended, as in a crash): the lease expires within
        ``ttl_s`` and a standby takes over; :meth:`release` still marks it released. Once this
        returns no renewal is written: one in flight has finished, a later tick sees the stop."""
        self._stop.set()
        with self._mutex:
            pass

    def advertise(self, url: str) -> None:
        """Record the service URL that accepts writes for this store (shown to refused writers)."""
        self._holder["url"] = url
        self.renew()

    def release(self) -> None:
        """Stop renewing and mark the lease released, so the next writer need not wait."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._mutex:
            if self.lost is not None or not self.epoch:
                return
            try:
                self.storage.replace_if(LEASE_KEY, self._record(expires=0.0, released=True), self._token)
            except ObjectChanged:
                pass  # already taken over: nothing of ours to release
            except Exception:  # it expires on its own
                log.warning("could not release the writer lease of %s", self.storage.url, exc_info=True)
            self.lost = "this writer closed"


def _locked_message(url: str, rec: dict[str, Any], now: float) -> str:
    holder = rec.get("holder") or {}
    left = max(0.0, float(rec.get("expires", 0)) - now)
    fix = (f"send writes through that server (--server {holder['url']}, or MintClient({holder['url']!r}))"
           if holder.get("url") else "stop that process, or send writes through its server (--server URL)")
    return (f"store {url} is open for writing by {describe(holder)} (lease epoch {rec.get('epoch')}, "
            f"renewed; expires in {left:.0f} s if it stops); {fix}, or open this store read-only")
