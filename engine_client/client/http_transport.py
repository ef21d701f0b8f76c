"""The client over HTTP: pooled connections, timeouts, retries with backoff on 5xx and
connection errors (never on 4xx), typed errors from the ``{"error": code}`` body."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import random
import tarfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import aiohttp

from mint_store import Location, PublishResult, VersionInfo
from mint_store.errors import AdapterNotFound, IntegrityError, MintError, NotFound, TagNotFound
from mint_store.format.blocks import Grid, RowBlocks
from mint_store.format.names import parse_ref
from mint_store.read import RowCheck
from mint_store.read.buffers import row_buffer

from ..errors import TERMINAL_CODES, ConnectionFailed, error_from_body
from .base import EventBatch, MintClient, version_info
from .http_ranges import fill_ranges, range_groups, range_header

if TYPE_CHECKING:
    from mint_store.format.adapter import Adapter
    from mint_store.format.layout import Layout

T = TypeVar("T")
_PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
_RETRY_STATUS = frozenset({500, 502, 503, 504})
VERSIONS_PAGE = 1000  # versions asked for per request (the service answers at most 1,000)



class _DoneBefore(Exception):
    """A resent request's answer says an earlier attempt of it took effect (see ``_call``)."""


class _Retry(Exception):
    """A response worth another attempt (internal)."""

    def __init__(self, err: MintError) -> None:
        self.err = err


class HttpMintClient(MintClient, transport="http"):
    def __init__(self, url: str | os.PathLike[str], token: str | None = None, **options: Any) -> None:
        super().__init__(url, token, **options)
        self.url = self.url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # created on first use: a session belongs to the loop that runs it
        if self._session is None or self._session.closed:
            c = self.config
            headers = {"Authorization": f"Bearer {c.token}"} if c.token else {}
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=c.max_connections, limit_per_host=c.max_connections),
                timeout=aiohttp.ClientTimeout(
                    total=c.request_timeout, sock_connect=c.connect_timeout, sock_read=c.read_timeout
                ),
                headers=headers,
                raise_for_status=False,
            )
            # aiohttp resends a PUT or DELETE by itself once when the connection drops, even after
            # the server acted on it (a publish stored twice): _call is the only retry policy
            self._session._retry_connection = False
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- one request, retried ------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        consume: Callable[[aiohttp.ClientResponse], Awaitable[T]],
        *,
        idempotent: bool = True,
        body: Callable[[], dict[str, Any]] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
        params: Mapping[str, str] | None = None,
        done_if_resent: type[MintError] | None = None,
    ) -> T:
        """Send, retrying what may be retried, and hand a 2xx response to ``consume``.

        Idempotent requests retry on any connection error, timeout or retryable 5xx.
        Others (publish) retry only where the server cannot have acted: a refused
        connection, or a 503. ``done_if_resent``: an error that, answering a resent request,
        says an earlier attempt did it (an untag's tag_not_found): :class:`_DoneBefore` is raised.
        """
        session = self._client()
        attempt = 0
        while True:
            try:
                kwargs = body() if body is not None else {}
                async with session.request(method, self.url + path, params=params, timeout=timeout,
                                           **kwargs) as resp:
                    if resp.status >= 400:
                        err = await self._failure(resp, idempotent)
                        if attempt and done_if_resent is not None and isinstance(err, done_if_resent):
                            raise _DoneBefore from err
                        raise err
                    return await consume(resp)
            except _Retry as r:
                if attempt >= self.config.retries:
                    raise r.err from None
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ClientPayloadError, TimeoutError) as e:
                refused = isinstance(e, aiohttp.ClientConnectorError)
                if attempt >= self.config.retries or not (idempotent or refused):
                    raise ConnectionFailed(f"{method} {self.url}{path}: {e or type(e).__name__}") from e
            attempt += 1
            await asyncio.sleep(self._delay(attempt))

    def _delay(self, attempt: int) -> float:
        c = self.config
        return min(c.max_backoff, c.backoff * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    async def _failure(self, resp: aiohttp.ClientResponse, idempotent: bool) -> BaseException:
        try:
            payload = json.loads(await resp.read())
        except (ValueError, aiohttp.ClientError):
            payload = None
        err = error_from_body(resp.status, payload)
        if resp.status in _RETRY_STATUS and err.code not in TERMINAL_CODES and (idempotent or resp.status == 503):
            return _Retry(err)
        return err

    async def _json(self, method: str, path: str, *, idempotent: bool = True, **kw: Any) -> Any:
        payload = kw.pop("json", None)

        async def read(resp: aiohttp.ClientResponse) -> Any:
            return await resp.json(content_type=None)

        body = (lambda: {"json": payload}) if payload is not None else None
        return await self._call(method, path, read, idempotent=idempotent, body=body, **kw)

    # -- the interface -------------------------------------------------------------------------

    async def _resolve_batch(self, refs: Sequence[str]) -> list[Location | MintError]:
        got = await self._json("POST", "/v1/resolve", json={"refs": list(refs)})
        out: list[Location | MintError] = []
        for item in got["results"]:
            if "location" in item:
                out.append(Location(**item["location"]))
            else:
                out.append(error_from_body(404, item))
        return out

    async def read_row(self, loc: Location, out: Any = None, *, verify: bool = True) -> Any:
        out, view = row_buffer(loc.length, out)

        async def fill(resp: aiohttp.ClientResponse) -> None:
            if resp.content_length != loc.length:
                raise IntegrityError(f"row {loc.content_id}: server sent {resp.content_length} bytes, "
                                     f"expected {loc.length}")
            check = RowCheck(loc) if verify else None  # (a retry starts a fresh one)
            pos = 0
            while pos < loc.length:
                chunk = await resp.content.readany()
                if not chunk:
                    raise aiohttp.ClientPayloadError(f"row {loc.content_id} ended after {pos} bytes")
                if pos + len(chunk) > loc.length:
                    raise IntegrityError(f"row {loc.content_id}: server sent more than {loc.length} bytes")
                view[pos : pos + len(chunk)] = chunk
                if check is not None:
                    check.update(chunk)  # one pass: hashed as it lands, while it is in cache
                pos += len(chunk)
            if check is not None and not check.matches():
                raise IntegrityError(f"row received for content id {loc.content_id} does not match it")

        await self._call("GET", f"/v1/blobs/{loc.content_id}", fill)
        return out

    async def read_ranges(self, loc: Location, ranges: Sequence[tuple[int, int]], out: Any) -> int:
        _, view = row_buffer(loc.length, out)

        async def one(group: Sequence[tuple[int, int]]) -> int:
            async def fill(resp: aiohttp.ClientResponse) -> int:
                return await fill_ranges(resp, loc, group, view)

            return await self._call("GET", f"/v1/blobs/{loc.content_id}", fill,
                                    body=lambda: {"headers": {"Range": range_header(group)}})

        # a server bounds one header (the service: 8190 bytes): many ranges go in a few requests, at once
        return sum(await asyncio.gather(*(one(g) for g in range_groups(ranges))))

    async def row_blocks(self, loc: Location) -> RowBlocks | None:
        async def read(resp: aiohttp.ClientResponse) -> RowBlocks | None:
            if resp.status == 204:
                return None
            try:
                blocks, min_block = (int(x) for x in resp.headers["X-Mint-Grid"].split(","))
            except (KeyError, ValueError):
                raise IntegrityError(f"block digests of {loc.content_id}: no valid X-Mint-Grid header") from None
            return RowBlocks(Grid(blocks, min_block), bytes(await resp.read()))

        try:
            return await self._call("GET", f"/v1/blobs/{loc.content_id}/blocks", read)
        except MintError as e:  # a 404: a service older than block digests (no such route): read the row
            if isinstance(e, NotFound) or getattr(e, "status", None) == 404:  # whole, which also reports
                return None  # a row that is really gone, with its own error
            raise

    async def version(self, ref: str) -> VersionInfo:
        r = parse_ref(ref)
        if r.content_id is not None:
            raise AdapterNotFound(f"{ref} does not name a version")
        path = _adapter_path(r.tenant, r.name)
        if r.version is not None:
            path += f"/versions/{r.version}"
        elif r.tag is not None:
            path += f"/tags/{_q(r.tag)}"
        return version_info(await self._json("GET", path))

    async def versions(self, tenant: str, name: str) -> list[VersionInfo]:
        out: list[VersionInfo] = []
        after: int | None = 0
        while after is not None:  # every page (the service answers at most 1,000 versions at once)
            got = await self._json("GET", _adapter_path(tenant, name) + "/versions",
                                   params={"after": str(after), "limit": str(VERSIONS_PAGE)})
            out += [version_info(v) for v in got["versions"]]
            nxt = got.get("next")
            after = int(nxt) if nxt is not None and got["versions"] and int(nxt) > after else None
        return out

    async def names(self, tenant: str, *, prefix: str = "", after: str | None = None, limit: int = 1000) -> list[str]:
        params = {"prefix": prefix, "limit": str(limit)} | ({"after": after} if after else {})
        return list((await self._json("GET", f"/v1/adapters/{_q(tenant)}", params=params))["names"])

    async def _layout(self, layout_id: str) -> Layout:
        from mint_store.format.layout import Layout

        return Layout.from_dict(await self._json("GET", f"/v1/layouts/{_q(layout_id)}"))

    async def base(self, base: str) -> dict[str, list[int]]:
        return dict((await self._json("GET", f"/v1/bases/{_q(base)}"))["shapes"])

    async def register_base(self, base: str, shapes: Mapping[str, Sequence[int]]) -> None:
        await self._json("PUT", f"/v1/bases/{_q(base)}", json={k: list(v) for k, v in shapes.items()})

    async def bases(self) -> dict[str, int]:
        return {b["base"]: int(b["modules"]) for b in (await self._json("GET", "/v1/bases"))["bases"]}

    async def tenants(self) -> list[str]:
        return list((await self._json("GET", "/v1/tenants"))["tenants"])

    async def publish(
        self, tenant: str, name: str, source: str | os.PathLike[str] | Adapter, *,
        base: str | None = None, tag: str | None = None,
    ) -> PublishResult:
        files = await _peft_sources(source)
        if base is None and not isinstance(source, str | os.PathLike):
            base = source.base
        params = {k: v for k, v in (("base", base), ("tag", tag)) if v is not None}

        def form() -> dict[str, Any]:
            data = aiohttp.FormData()
            for field, src in zip(_PEFT_FILES, files, strict=True):
                value = open(src, "rb") if isinstance(src, Path) else src  # noqa: SIM115 - aiohttp closes it
                data.add_field(field, value, filename=field, content_type="application/octet-stream")
            return {"data": data}

        async def read(resp: aiohttp.ClientResponse) -> PublishResult:
            d = await resp.json(content_type=None)
            return PublishResult(d["tenant"], d["name"], int(d["version"]), d["content_id"], d["layout_id"],
                                 int(d["nbytes"]), bool(d["deduplicated"]), int(d["seq"]))

        path = _adapter_path(tenant, name)
        return await self._call("PUT", path, read, idempotent=False, body=form, params=params)

    async def tag(self, ref: str, tag: str) -> int:
        r = parse_ref(ref)
        if r.content_id is not None:
            raise AdapterNotFound("tags name versions of tenant/name, not content ids")
        version = r.version if r.version is not None else (await self.version(ref)).version
        path = _adapter_path(r.tenant, r.name) + f"/tags/{_q(tag)}"
        return int((await self._json("PUT", path, json={"version": version}))["version"])

    async def untag(self, tenant: str, name: str, tag: str) -> None:
        # resent after a lost answer, the tag is already gone: that is this call's own success
        with contextlib.suppress(_DoneBefore):
            await self._json("DELETE", _adapter_path(tenant, name) + f"/tags/{_q(tag)}", done_if_resent=TagNotFound)

    async def delete(self, ref: str) -> int:
        r = parse_ref(ref)
        if r.content_id is not None:
            raise AdapterNotFound("delete takes tenant/name[@version|:tag], not a content id")
        version = r.version if r.version is not None else (await self.version(ref)).version
        path = _adapter_path(r.tenant, r.name) + f"/versions/{version}"
        return int((await self._json("DELETE", path, idempotent=False))["version"])

    async def events(self, after: int = 0, *, wait: float = 0.0, limit: int = 1000) -> EventBatch:
        c = self.config
        # a long poll is silent for up to `wait` seconds: give the read that long and more
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=c.connect_timeout, sock_read=wait + c.read_timeout)
        params = {"after": str(after), "wait": repr(float(wait)), "limit": str(limit)}
        got = await self._json("GET", "/v1/events", params=params, timeout=timeout)
        return EventBatch(tuple(got["events"]), int(got["last_seq"]), int(got["head"]))

    async def pull(self, ref: str, dest: str | os.PathLike[str]) -> Path:
        r = parse_ref(ref)
        if r.content_id is not None:
            raise AdapterNotFound("pull takes tenant/name[@version|:tag]; content ids have no PEFT config")
        info = await self.version(ref)  # its content id: what the files must hold
        path = _adapter_path(r.tenant, r.name) + f"/versions/{info.version}/peft"

        async def read(resp: aiohttp.ClientResponse) -> bytes:
            return await resp.read()

        data = await self._call("GET", path, read)
        return await asyncio.to_thread(_extract_peft, data, Path(dest), info)

    async def stats(self) -> dict[str, Any]:
        """Index statistics (admin token)."""
        return dict(await self._json("GET", "/v1/admin/stats"))


def _q(part: str | None) -> str:
    return quote(part or "", safe="")


def _adapter_path(tenant: str | None, name: str | None) -> str:
    return f"/v1/adapters/{_q(tenant)}/{_q(name)}"


async def _peft_sources(source: Any) -> tuple[Path | bytes, Path | bytes]:
    """The two PEFT files of ``source``: paths of a directory, or bytes of an Adapter."""
    if isinstance(source, str | os.PathLike):
        from mint_store.peft.directory import check_peft_dir

        d = check_peft_dir(source)
        paths = (d / _PEFT_FILES[0], d / _PEFT_FILES[1])
        for p in paths:
            if not p.is_file():
                from mint_store.errors import InvalidAdapter

                raise InvalidAdapter(f"{str(d)!r} has no {p.name}")
        return paths
    from mint_store.peft.directory import peft_files

    return await asyncio.to_thread(peft_files, source)


def _extract_peft(data: bytes, dest: Path, info: VersionInfo) -> Path:
    """Write the two PEFT files of an export tar into ``dest``; nothing else is taken.

    Checked first, as every row read is: the files must import to the version's content id
    (same tensors, same layout), else IntegrityError and ``dest`` is left as it was.
    """
    from mint_store.errors import InvalidAdapter
    from mint_store.peft.directory import load_peft_files

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        if set(members) != set(_PEFT_FILES):
            raise IntegrityError(f"PEFT export holds {sorted(members)}, expected {list(_PEFT_FILES)}")
        files: dict[str, bytes] = {}
        for name in _PEFT_FILES:
            f = tar.extractfile(members[name])
            if f is None:  # pragma: no cover - isfile() members always extract
                raise IntegrityError(f"cannot read {name} from the PEFT export")
            files[name] = f.read()
    try:
        got = load_peft_files(files[_PEFT_FILES[0]], files[_PEFT_FILES[1]], base=info.base).content_id()
    except InvalidAdapter as e:
        raise IntegrityError(f"the PEFT export of {info.ref} does not import: {e}") from None
    if got != info.content_id:
        raise IntegrityError(f"the PEFT export of {info.ref} holds content {got}, not the version's "
                             f"{info.content_id}")
    dest.mkdir(parents=True, exist_ok=True)
    for name in _PEFT_FILES:
        tmp = dest / f".{name}.tmp"
        tmp.write_bytes(files[name])
        os.replace(tmp, dest / name)
    return dest
