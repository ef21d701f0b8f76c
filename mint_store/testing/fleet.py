"""Kill-safety check of a fleet: writer + standby + 2 replicas on one S3 bucket (moto, loopback).

A writer ``mint serve``, a ``mint serve --standby`` and two ``mint serve --replica``, each
with its own index directory, share one bucket of moto's S3 server (run in this process),
with a short writer lease. Publishers here send a storm of publishes over HTTP to whoever
is the writer (a 405 names it; otherwise ``/healthz`` of the writer-capable servers does)
and record every acknowledged one (name, version, content id). Meanwhile, at random
moments, the writer or the standby is SIGKILLed (and relaunched as a standby, so that
there is always a candidate) or SIGSTOPped and later SIGCONTed (a zombie writer that
resumes after a take-over is fenced; it is then relaunched as a standby too). The first
event SIGKILLs the writer, so every run has a take-over. Events are bounded in number
and time; between two events the fleet settles (a writer is serving and the storm got an
acknowledgement from it).

Afterwards, on every surviving process (the writer, the standbys, the replicas once their
``last_seq`` reached the writer's): every acknowledged publish reads back with its content
id and the exact bytes published, and every version the process lists reads back bytes
that hash to its content id. Then the servers stop, and the store, opened here, passes
``fsck`` (orphans a fenced writer left are removed, as ``sweep`` would) with every
acknowledged publish exact. Waits poll state with generous bounds; nothing is timed.
"""

from __future__ import annotations

import asyncio
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from .crashtest import CrashReport, _verify, synthetic_adapter
from .fleet_procs import TENANT, WAIT_S, Moto, Server, get_content, get_json, health, is_writer, publish

Acks = dict[tuple[str, int], tuple[str, int]]  # (name, version) -> (content id, seed)


@dataclass(slots=True)
class FleetReport:
    mode: str = "fleet"
    kills: int = 0  # disruptive events: SIGKILLs and SIGSTOPs
    sigkills: int = 0
    sigstops: int = 0
    takeovers: int = 0  # writer lease epochs after the first
    fenced_relaunched: int = 0  # zombies that resumed fenced, relaunched as standbys
    events: list[str] = field(default_factory=list)  # what was done to whom, in order
    acknowledged: int = 0
    publish_failures: int = 0  # refused or cut off: never acknowledged, so never checked
    processes_checked: int = 0
    last_seq: int = 0
    orphans_removed: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(slots=True, eq=False)
class Fleet:
    servers: list[Server]
    http: aiohttp.ClientSession
    report: FleetReport
    moto: Moto
    acks: Acks = field(default_factory=dict)
    writer_guess: str | None = None
    stopping: bool = False
    next_seed: int = 0
    seen_exits: set[tuple[str, int]] = field(default_factory=set)
    storage: Any = None  # the store's storage, for reading the lease

    def __post_init__(self) -> None:
        from ..storage import open_storage

        self.storage = open_storage(self.moto.url, storage_options=self.moto.storage_options())

    @property
    def candidates(self) -> list[Server]:
        return [s for s in self.servers if s.role != "replica"]

    def problem(self, text: str) -> None:
        self.report.problems.append(text)

    def check_exits(self) -> None:
        """A server that exited although nothing killed it is a problem (its log says why)."""
        for s in self.servers:
            code = s.exited()
            if code is not None and (s.name, s.launches) not in self.seen_exits:
                self.seen_exits.add((s.name, s.launches))
                self.problem(f"{s.name} ({s.role}) exited by itself with {code}: {s.log_tail()}")

    async def writer(self) -> Server | None:
        """The candidate that serves as the writer and holds the lease, or None."""
        from ..fleet.standby import read_lease

        lease = await asyncio.to_thread(read_lease, self.storage)
        holder = (lease or {}).get("holder") or {}
        for s in self.candidates:
            if s.url is not None and s.url == holder.get("url") and is_writer(await health(self.http, s.url)):
                return s
        return None

    async def find_writer(self) -> str | None:
        """For the publishers: any candidate whose healthz says it is a writable writer."""
        found = await asyncio.gather(*(health(self.http, s.url) for s in self.candidates))
        urls = [s.url for s, h in zip(self.candidates, found, strict=True) if is_writer(h)]
        return urls[0] if urls else None

    async def until(self, probe: Any, what: str) -> Any:
        """Poll ``probe`` (async) until it returns a truthy value; None (and a problem) past the bound."""
        stop = time.monotonic() + WAIT_S
        while not (got := await probe()):
            self.check_exits()
            if time.monotonic() > stop:
                self.problem(f"timed out waiting for {what}")
                return None
            await asyncio.sleep(0.05)
        return got


def run_fleet(workdir: str | Path | None = None, *, kills: int = 6, seed: int = 0, max_seconds: float = 300.0,
              max_wait_s: float = 1.5, ttl_s: float = 2.0, renew_s: float = 0.3, publishers: int = 2) -> FleetReport:
    """Run the fleet check; a report whose ``problems`` is empty when everything held.

    Parameters
    ----------
    workdir
        Where the servers' index directories and logs go (default: a new temporary directory).
    kills
        Disruptive events (SIGKILL or SIGSTOP of the writer or the standby).
    max_seconds
        Bound on the storm's duration (the checks after it are not counted).
    max_wait_s
        Upper bound of the random delay before each event, after the fleet settled.
    ttl_s, renew_s
        The writer lease's TTL and renew interval (``--lease-ttl``, ``--lease-renew``).
    """
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="mint-fleet-"))
    work.mkdir(parents=True, exist_ok=True)
    report = FleetReport()
    t0 = time.monotonic()
    moto = Moto()
    servers = [Server(name, role, work, moto, ttl_s, renew_s) for name, role in
               (("w", "writer"), ("s", "standby"), ("r1", "replica"), ("r2", "replica"))]
    try:
        acks = asyncio.run(_run(servers, moto, report, random.Random(seed), kills=kills, max_seconds=max_seconds,
                                max_wait_s=max_wait_s, ttl_s=ttl_s, publishers=publishers))
        report.takeovers = max(0, _lease_epoch(moto) - 1)
        for s in reversed(servers):  # the writer last: a standby would take a released lease
            s.terminate()
        _verify_store(moto, work, acks, report)
    finally:
        for s in servers:
            s.kill()
        moto.stop()
    report.acknowledged = len(acks)
    report.seconds = time.monotonic() - t0
    return report


async def _run(servers: list[Server], moto: Moto, report: FleetReport, rng: random.Random, *, kills: int,
               max_seconds: float, max_wait_s: float, ttl_s: float, publishers: int) -> Acks:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        fleet = Fleet(servers, http, report, moto)
        servers[0].launch("writer")  # first, alone: it creates the store and takes the lease
        await servers[0].ready()
        for s in servers[1:]:
            s.launch(s.role)
        for s in servers[1:]:
            await s.ready()
        pubs = [asyncio.create_task(_publisher(fleet)) for _ in range(publishers)]
        try:
            await _storm(fleet, rng, kills=kills, max_seconds=max_seconds, max_wait_s=max_wait_s, ttl_s=ttl_s)
        finally:
            fleet.stopping = True
            for failed in await asyncio.gather(*pubs, return_exceptions=True):
                if failed is not None:
                    fleet.problem(f"a publisher failed: {failed!r}")
        await _check_processes(fleet)
        fleet.storage.close()
        return fleet.acks


async def _settled(fleet: Fleet, acked_before: int) -> bool:
    """A writer serves, every candidate answers, and the storm got an ack since the last event."""
    async def probe() -> bool:
        if fleet.stopping:
            return True  # a publisher failed: nothing more to wait for
        found = await asyncio.gather(*(health(fleet.http, s.url) for s in fleet.servers))
        for s, h in zip(fleet.servers, found, strict=True):
            if h is not None and h.get("status") == "degraded":  # nothing of ours stalled it: a problem
                fleet.problem(f"{s.name} ({s.role}) degraded, relaunched as a standby: {h.get('reason')}")
                s.kill()
                await _relaunch(fleet, s)
                return False
        if await fleet.writer() is None or len(fleet.acks) <= acked_before:
            return False
        return all(h is not None for h in found)

    return bool(await fleet.until(probe, f"the fleet to settle after event {fleet.report.kills}"))


async def _storm(fleet: Fleet, rng: random.Random, *, kills: int, max_seconds: float, max_wait_s: float,
                 ttl_s: float) -> None:
    t0 = time.monotonic()
    report = fleet.report
    while report.kills < kills and time.monotonic() - t0 < max_seconds and not fleet.stopping:
        if not await _settled(fleet, len(fleet.acks)):
            return
        await asyncio.sleep(rng.uniform(0.2, max_wait_s))
        await _disrupt(fleet, rng, first=report.kills == 0, ttl_s=ttl_s)
        report.kills += 1
    await _settled(fleet, len(fleet.acks))


async def _disrupt(fleet: Fleet, rng: random.Random, *, first: bool, ttl_s: float) -> None:
    """SIGKILL (then relaunch as a standby) or SIGSTOP (then SIGCONT) the writer or a standby."""
    writer = await fleet.writer()
    others = [s for s in fleet.candidates if s is not writer]
    target = writer if writer is not None and (first or not others or rng.random() < 0.6) else rng.choice(others)
    role = "writer" if target is writer else target.role
    if first or rng.random() < 0.5:
        target.kill()
        fleet.report.sigkills += 1
        fleet.report.events.append(f"SIGKILL {target.name} ({role}) after {len(fleet.acks)} acks")
        await _relaunch(fleet, target)
        return
    target.signal(signal.SIGSTOP)
    fleet.report.sigstops += 1
    pause = rng.uniform(0.3, 2.5 * ttl_s)  # past the TTL or not: both must be safe
    await asyncio.sleep(pause)
    target.signal(signal.SIGCONT)
    state = await _after_resume(fleet, target)
    fleet.report.events.append(f"SIGSTOP {target.name} ({role}) for {pause:.1f} s after {len(fleet.acks)} acks: "
                               f"resumed as {state}")


async def _relaunch(fleet: Fleet, server: Server) -> None:
    server.launch("standby")  # on its old index directory, as a machine that reboots
    try:
        await server.ready()
    except RuntimeError as e:
        fleet.problem(str(e))


async def _after_resume(fleet: Fleet, server: Server) -> str | None:
    """Wait until a resumed server is a standby or the lease's writer; a fenced zombie is relaunched."""
    async def probe() -> str | None:
        h = await health(fleet.http, server.url)
        if h is None:
            return None
        if h.get("status") == "standby":
            return "standby"
        if h.get("status") == "degraded":  # fenced: it can never write again
            return "fenced"
        writer = await fleet.writer()
        return "writer" if writer is server else None

    state = await fleet.until(probe, f"{server.name} to settle after SIGCONT")
    if state == "fenced":
        server.kill()
        fleet.report.fenced_relaunched += 1
        await _relaunch(fleet, server)
    return state


async def _publisher(fleet: Fleet) -> None:
    """Publish until told to stop; record each acknowledgement (201 with its version and content id)."""
    try:
        await _publish_storm(fleet)
    except BaseException:
        fleet.stopping = True  # the storm is over: the event loop stops waiting for acks
        raise


async def _publish_storm(fleet: Fleet) -> None:
    while not fleet.stopping:
        seed = fleet.next_seed
        fleet.next_seed += 1
        name = f"a{seed % 11}"
        url = fleet.writer_guess or await fleet.find_writer()
        if url is None:
            await asyncio.sleep(0.05)
            continue
        adapter = synthetic_adapter(seed)
        from ..peft.directory import peft_files

        try:
            status, body = await publish(fleet.http, url, name, peft_files(adapter), adapter.base, timeout=20.0)
        except (aiohttp.ClientError, TimeoutError):
            status, body = 0, {}
        if status == 201:
            _record(fleet, body, seed)
            fleet.writer_guess = url
            continue
        fleet.report.publish_failures += 1
        writer_url = body.get("writer_url") if status == 405 else None
        fleet.writer_guess = writer_url if isinstance(writer_url, str) else None
        if fleet.writer_guess is None:
            await asyncio.sleep(0.05)


def _record(fleet: Fleet, body: dict[str, Any], seed: int) -> None:
    key = (str(body["name"]), int(body["version"]))
    if key in fleet.acks and fleet.acks[key][0] != body["content_id"]:
        fleet.problem(f"{TENANT}/{key[0]}@{key[1]} acknowledged twice: {fleet.acks[key][0]}, then "
                      f"{body['content_id']}")
    fleet.acks[key] = (str(body["content_id"]), seed)


async def _check_processes(fleet: Fleet) -> None:
    """On each surviving server, once it caught up with the writer: every ack exact, every version sound."""
    writer = await fleet.until(fleet.writer, "a writer after the storm")
    if writer is None:
        return
    h = await health(fleet.http, writer.url)
    head = int(h["last_seq"]) if h else 0
    fleet.report.last_seq = head
    expected = {seed: synthetic_adapter(seed).to_row()[1].tobytes() for _, seed in fleet.acks.values()}
    for s in fleet.servers:
        if s.exited() is not None:
            continue

        async def caught_up(server: Server = s) -> bool:
            got = await health(fleet.http, server.url)
            return got is not None and int(got.get("last_seq", -1)) >= head

        if await fleet.until(caught_up, f"{s.name} ({s.role}) to reach seq {head}"):
            fleet.report.problems += await _check_one(fleet.http, s, fleet.acks, expected)
            fleet.report.processes_checked += 1
    fleet.check_exits()


async def _check_one(http: aiohttp.ClientSession, server: Server, acks: Acks,
                     expected: dict[int, bytes]) -> list[str]:
    from ..format.hashing import content_id

    problems: list[str] = []
    where = f"on {server.name} (launched as {server.role})"
    gate = asyncio.Semaphore(8)
    listed: dict[tuple[str, int], str] = {}
    for name in sorted({n for n, _ in acks} | {f"a{i}" for i in range(11)}):
        status, body = await get_json(http, f"{server.url}/v1/adapters/{TENANT}/{name}/versions")
        if status == 200:
            listed |= {(name, int(v["version"])): str(v["content_id"]) for v in body["versions"] if not v["deleted"]}

    async def one(key: tuple[str, int]) -> None:
        ref = f"{TENANT}/{key[0]}@{key[1]}"
        async with gate:
            status, row, headers = await get_content(http, f"{server.url}/v1/adapters/{TENANT}/{key[0]}/versions/"
                                                           f"{key[1]}/content")
        if status != 200:
            problems.append(f"{ref} {where}: content answered {status}")
            return
        cid = listed.get(key)
        if cid is None or content_id(headers.get("X-Mint-Layout-Id", ""), np.frombuffer(row, np.uint8)) != cid:
            problems.append(f"{ref} {where}: the bytes do not hash to its listed content id {cid}")
        if key in acks:
            acked_cid, seed = acks[key]
            if cid != acked_cid:
                problems.append(f"{ref} {where}: content id {cid}, acknowledged {acked_cid}")
            elif row != expected[seed]:
                problems.append(f"{ref} {where}: the bytes differ from those published")

    problems += [f"{TENANT}/{n}@{v} {where}: acknowledged but not listed" for n, v in sorted(set(acks) - set(listed))]
    await asyncio.gather(*(one(k) for k in sorted(listed)))
    return problems


def _lease_epoch(moto: Moto) -> int:
    from ..fleet.standby import read_lease
    from ..storage import open_storage

    lease = read_lease(open_storage(moto.url, storage_options=moto.storage_options()))
    return int((lease or {}).get("epoch", 0))


def _verify_store(moto: Moto, work: Path, acks: Acks, report: FleetReport) -> None:
    """The servers are stopped: open the store here (a fresh index from the store), fsck it, check acks."""
    from ..errors import WriterLocked

    crash = CrashReport("fleet")
    stop = time.monotonic() + WAIT_S
    while True:  # a SIGKILLed holder's lease expires within its TTL
        try:
            report.problems += _verify(moto.url, acks, crash, index_dir=str(work / "verify-index"),
                                       storage_options=moto.storage_options())
            break
        except WriterLocked:
            if time.monotonic() > stop:
                raise
            time.sleep(0.2)
    report.orphans_removed = crash.orphans_removed
