"""The Hugging Face Hub read protocol under ``/hf``: ``HF_ENDPOINT=http://HOST:8470/hf``.

``huggingface_hub`` (and what downloads through it: PEFT's ``from_pretrained``, vLLM's LoRA
loader, ``hf download``) reads MinT adapters with no plugin. What its client calls, and
answers here (huggingface_hub 2.x: ``hf_api.py``, ``file_download.py``, ``_snapshot_download.py``):

* ``GET /api/models/{repo}[/revision/{rev}]``: model info; ``sha`` is the commit id,
  ``siblings`` the files (``?blobs=true``: with sizes and LFS ids).
* ``GET /api/models/{repo}/tree/{rev}``: the file list ``snapshot_download`` caches per commit.
* ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: ``ETag``, ``X-Repo-Commit``,
  ``Content-Length``, ``Range`` (206). Every file answers at a moving revision (a tag,
  ``main``) with a 302 to the same file at its commit (the weights with ``X-Linked-Etag``,
  SHA-256, and ``X-Linked-Size``, as the Hub does for LFS files): the client then downloads
  exactly the bytes of the commit it recorded, even if the tag moves in between.
* Errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``),
  which the client turns into its error classes. A tenant the token does not hold is a repo
  that does not exist (404), as a private repo is on the Hub; a request without a token is a
  401 with ``RepoNotFound``, one with an unknown token a 401 "Invalid credentials".

The two PEFT files are rendered once per commit by the same code as ``mint pull``
(``peft_files``) and kept in an LRU by bytes.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from ...errors import AdapterNotFound, InvalidName, NotFound, TagNotFound, VersionDeleted
from ...format.names import check_name
from ...peft.directory import peft_files
from ...results import VersionInfo
from ...store import Store
from ..deadlines import deadline_paused, send_within
from ..errors import HubEntryNotFound, HubRepoNotFound, HubRevisionNotFound
from ..routes.parsing import route_label
from ..rows.serving import parse_range
from ..state import ServiceState, principal_of, state_of
from .repo import (
    FILES,
    README_NAME,
    HubFile,
    Revision,
    Summary,
    commit_of,
    config_file,
    model_card,
    model_info,
    parse_revision,
    summarize,
    weights_file,
)

PREFIX = "/hf"
CACHE_BYTES = 256 * 2**20  # rendered PEFT files kept across requests
_MAX_COMMITS = 100_000  # commit id -> version entries remembered
_CHUNK = 1 * 2**20
routes = web.RouteTableDef()


@dataclass(frozen=True, slots=True)
class Rendered:
    """The files of one commit that never change (the model card lists live tags: per request)."""

    config: HubFile
    weights: HubFile
    summary: Summary

    @property
    def nbytes(self) -> int:
        return self.config.size + self.weights.size


def _render(store: Store, ref: str) -> Rendered:
    adapter = store.load(ref)
    config, weights = peft_files(adapter)  # the bytes `mint pull` writes
    return Rendered(config_file(config), weights_file(weights), summarize(adapter))


class HubCache:
    """Rendered files by commit id (LRU by bytes) and commit id -> (tenant, name, version).

    Used only on the event loop: no locks. Concurrent requests for one commit share one render.
    """

    def __init__(self, budget: int = CACHE_BYTES) -> None:
        self.budget = budget
        self.nbytes = 0
        self._files: OrderedDict[str, Rendered] = OrderedDict()
        self._pending: dict[str, asyncio.Future[Rendered]] = {}
        self._commits: OrderedDict[str, tuple[str, str, int]] = OrderedDict()
        # per repo, every commit id of its versions up to the newest one scanned: an unknown commit
        # (a revision pinned before a restart, a typo, a guess) costs the versions published since,
        # not a scan of all of them on every request. LRU by repo, bounded by entries in all.
        self._repos: OrderedDict[tuple[str, str], tuple[int, dict[str, int]]] = OrderedDict()
        self._repo_entries = 0

    async def files(self, st: ServiceState, info: VersionInfo, commit: str, owner: str = "") -> Rendered:
        """The files of ``info`` (commit id ``commit``), rendered once; ``owner``: the caller whose
        share of ``read_memory`` a render it starts counts against."""
        hit = self._files.get(commit)
        if hit is not None:
            self._files.move_to_end(commit)
            return hit
        fut = self._pending.get(commit)
        if fut is None:
            fut = self._pending[commit] = asyncio.ensure_future(self._render(st, info, owner))
            fut.add_done_callback(lambda f: self._settle(commit, f))
        # shielded: a client that goes away does not cancel the render others wait for
        return await asyncio.shield(fut)

    @staticmethod
    async def _render(st: ServiceState, info: VersionInfo, owner: str) -> Rendered:
        # the adapter loaded and its files made (~2-3x its size) count against read_memory, as
        # a PEFT export's do: many commits rendered at once wait instead of piling up
        async with st.rows.buffers.hold(info.nbytes, owner):
            return await st.run(_render, st.store, info.ref)

    def _settle(self, commit: str, fut: asyncio.Future[Rendered]) -> None:
        self._pending.pop(commit, None)
        if fut.cancelled() or fut.exception() is not None:
            return
        got = fut.result()
        self._files[commit] = got
        self.nbytes += got.nbytes
        # the newest stays even when it alone is over the budget: its GET follows its HEAD
        while self.nbytes > self.budget and len(self._files) > 1:
            _, old = self._files.popitem(last=False)
            self.nbytes -= old.nbytes

    def __len__(self) -> int:
        return len(self._files)

    def remember(self, commit: str, info: VersionInfo) -> None:
        self._commits[commit] = (info.tenant, info.name, info.version)
        self._commits.move_to_end(commit)
        while len(self._commits) > _MAX_COMMITS:
            self._commits.popitem(last=False)

    def version_of(self, commit: str, tenant: str, name: str) -> int | None:
        got = self._commits.get(commit)
        if got is not None and got[:2] == (tenant, name):
            return got[2]
        scan = self._repos.get((tenant, name))
        return None if scan is None else scan[1].get(commit)

    def scanned_upto(self, tenant: str, name: str) -> int:
        """The newest version of ``tenant/name`` whose commit id is known here (0: none)."""
        scan = self._repos.get((tenant, name))
        if scan is None:
            return 0
        self._repos.move_to_end((tenant, name))
        return scan[0]

    def add_scan(self, tenant: str, name: str, upto: int, commits: dict[str, int]) -> None:
        """Record the commit ids of ``tenant/name``'s versions above the last scan, up to ``upto``."""
        key = (tenant, name)
        done, known = self._repos.pop(key, (0, {}))
        if upto <= done:
            self._repos[key] = (done, known)
            return
        self._repo_entries -= len(known)
        if len(known) + len(commits) > _MAX_COMMITS:  # one repo past the whole bound: not kept (its
            return  # misses scan its versions again, as before the cache; a partial map would lie)
        known.update(commits)
        self._repos[key] = (upto, known)
        self._repo_entries += len(known)
        while self._repo_entries > _MAX_COMMITS and len(self._repos) > 1:
            _, (_, dropped) = self._repos.popitem(last=False)
            self._repo_entries -= len(dropped)


HUB = web.AppKey("mint_hub", HubCache)


def setup_hub(app: web.Application) -> None:
    """Mount the Hub routes under ``/hf`` (called by ``create_app``)."""
    app[HUB] = HubCache()
    app.add_routes(routes)
    app.on_response_prepare.append(_hub_auth_headers)


async def _hub_auth_headers(request: web.Request, response: web.StreamResponse) -> None:
    """The Hub's 401s: without a token, ``RepoNotFound`` (the client says to log in); with an
    unknown one, "Invalid credentials" (the client does not pretend the repo is missing)."""
    if response.status != 401 or not request.path.startswith(PREFIX + "/") or "X-Error-Code" in response.headers:
        return
    if request.headers.get("Authorization"):
        response.headers["X-Error-Message"] = "Invalid credentials in Authorization header"
    else:
        response.headers["X-Error-Code"] = "RepoNotFound"
        response.headers["X-Error-Message"] = "Repository not found: send a MinT token as the Hub token (HF_TOKEN)"


def _repo(request: web.Request) -> tuple[str, str]:
    tenant, name = request.match_info["tenant"], request.match_info["name"]
    missing = HubRepoNotFound(f"no repo {ascii(tenant)[1:-1]}/{ascii(name)[1:-1]}")
    try:
        check_name(tenant, "tenant")
        check_name(name)
    except InvalidName:
        raise missing from None
    if not principal_of(request).holds(tenant):
        raise missing  # the same answer as a repo that does not exist
    return tenant, name


def _lookup(st: ServiceState, cache_versions: dict[str, int], tenant: str, name: str, rev: Revision,
            scan: dict[str, int], scanned_upto: int = 0) -> VersionInfo:
    """The version a revision names (runs on the executor). Raises the store's errors.

    An unknown commit id is looked for among the versions above ``scanned_upto`` (the cache
    knows the commit ids of those below); their commit ids go into ``scan`` for the cache.
    """
    store = st.store
    repo = f"{tenant}/{name}"
    if rev.kind == "latest":
        return store.version(repo)
    if rev.kind == "version":
        return store.version(f"{repo}@{rev.version}")
    if rev.commit is not None:
        known = cache_versions.get(rev.commit)
        if known is not None:
            return store.version(f"{repo}@{known}")
        found = None
        for info in store.versions(tenant, name, after=scanned_upto):  # AdapterNotFound for a missing repo
            c = commit_of(info)
            scan[c] = info.version
            if c == rev.commit:
                found = info
        if found is not None:
            return found
        if rev.tag is None:
            raise HubRevisionNotFound(f"no commit {rev.commit} in {repo}")
    try:
        return store.version(f"{repo}:{rev.tag}")
    except TagNotFound:
        store.version(repo)  # a missing repo says so, rather than "no such tag"
        raise


async def _version(request: web.Request, tenant: str, name: str, text: str) -> VersionInfo:
    st, cache = state_of(request), request.app[HUB]
    rev = parse_revision(text)
    known: dict[str, int] = {}
    upto = 0
    if rev.commit is not None:
        v = cache.version_of(rev.commit, tenant, name)
        if v is not None:
            known[rev.commit] = v
        upto = cache.scanned_upto(tenant, name)
    scan: dict[str, int] = {}
    try:
        try:
            info = await st.run(_lookup, st, known, tenant, name, rev, scan, upto)
        finally:
            if scan:  # (a miss too: the next unknown commit of this repo costs only newer versions)
                cache.add_scan(tenant, name, max(scan.values()), scan)
    except AdapterNotFound:
        raise HubRepoNotFound(f"no repo {tenant}/{name}") from None
    except (NotFound, VersionDeleted) as e:
        raise HubRevisionNotFound(f"revision {text!a} of {tenant}/{name}: {e}") from None
    if info.deleted:
        raise HubRevisionNotFound(f"revision {text!a} of {tenant}/{name}: version {info.version} is deleted")
    cache.remember(commit_of(info), info)
    return info


async def _files(request: web.Request, info: VersionInfo, commit: str) -> list[HubFile]:
    try:
        r = await request.app[HUB].files(state_of(request), info, commit, principal_of(request).label)
    except VersionDeleted:  # deleted between the lookup and the read
        raise HubRevisionNotFound(f"version {info.version} of {info.tenant}/{info.name} is deleted") from None
    return [r.config, r.weights, model_card(info, r.summary, commit)]


async def _model_info(request: web.Request, revision: str) -> web.Response:
    tenant, name = _repo(request)
    info = await _version(request, tenant, name, revision)
    commit = commit_of(info)
    blobs = request.query.get("blobs", "").lower() in ("1", "true")
    files = await _files(request, info, commit) if blobs else None
    private = state_of(request).tokens is not None
    return web.json_response(model_info(info, commit, private=private, files=files))


@routes.get(PREFIX + "/api/models/{tenant}/{name}", allow_head=False)
async def repo_info(request: web.Request) -> web.Response:
    try:
        return await _model_info(request, "main")
    except HubRevisionNotFound as e:
        # every version deleted: a repo with nothing in it. The client's repo_exists() and
        # model_info() without a revision expect "no such repo" (a revision error escaped them)
        tenant, name = _repo(request)
        raise HubRepoNotFound(f"{tenant}/{name} has no live version ({e})") from None


@routes.get(PREFIX + "/api/models/{tenant}/{name}/revision/{revision}", allow_head=False)
async def repo_info_at(request: web.Request) -> web.Response:
    return await _model_info(request, request.match_info["revision"])


@routes.get(PREFIX + "/api/models/{tenant}/{name}/tree/{revision}", allow_head=False)
async def tree(request: web.Request) -> web.Response:
    tenant, name = _repo(request)
    info = await _version(request, tenant, name, request.match_info["revision"])
    files = await _files(request, info, commit_of(info))
    return web.json_response([f.tree_entry() for f in files])


@routes.get(PREFIX + "/{tenant}/{name}/resolve/{revision}/{filename:.+}", allow_head=True)
async def resolve_file(request: web.Request) -> web.StreamResponse:
    tenant, name = _repo(request)
    revision, filename = request.match_info["revision"], request.match_info["filename"]
    info = await _version(request, tenant, name, revision)
    commit = commit_of(info)
    if filename not in FILES:
        # with the commit, so the client caches that the file does not exist there
        raise HubEntryNotFound(f"{tenant}/{name} has no file {filename!a}; it has {', '.join(FILES)}",
                               headers={"X-Repo-Commit": commit})
    f = {x.name: x for x in await _files(request, info, commit)}[filename]
    headers = {"X-Repo-Commit": commit, "ETag": f'"{f.etag}"', "Accept-Ranges": "bytes",
               "Content-Type": f.content_type}
    if f.lfs_sha256 is not None:
        headers |= {"X-Linked-Etag": f'"{f.lfs_sha256}"', "X-Linked-Size": str(f.size)}
    if revision != commit:
        # a moving revision: every file pinned to the commit (relative to this URL). Sent here,
        # a tag moved between the client's HEAD and its GET gave it the next commit's bytes,
        # cached under the first one's commit and ETag
        return web.Response(status=302, headers=headers | {"Location": f"../{commit}/{filename}"})
    pinned = revision == commit and filename != README_NAME  # the card lists live tags
    headers["Cache-Control"] = "private, max-age=31536000, immutable" if pinned else "private, no-cache"
    if request.method == "HEAD":
        return await _send(request, f, headers)
    # the file stays in memory while a client reads it, even once the cache has let it go
    async with state_of(request).rows.buffers.hold(f.size, principal_of(request).label):
        return await _send(request, f, headers)


async def _send(request: web.Request, f: HubFile, headers: dict[str, str]) -> web.StreamResponse:
    inm = request.headers.get("If-None-Match")
    if inm and f.etag in {t.strip().removeprefix("W/").strip('"') for t in inm.split(",")}:
        return web.Response(status=304, headers=headers)
    if_range = request.headers.get("If-Range")
    fresh = if_range is None or if_range.strip().removeprefix("W/").strip('"') == f.etag
    rng = parse_range(request.headers.get("Range"), f.size) if fresh else None
    start, stop = (rng.start, rng.stop) if rng is not None else (0, f.size)
    resp = web.StreamResponse(status=206 if rng is not None else 200, headers=headers)
    if rng is not None:
        resp.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{f.size}"
    resp.content_length = stop - start
    await resp.prepare(request)
    if request.method != "HEAD":
        view = memoryview(f.data)
        st = state_of(request)
        with deadline_paused(request, None):  # a slow download is the client's pace, not a hung request
            for pos in range(start, stop, _CHUNK):  # ... but one that stops reading is cut off
                await send_within(request, resp.write(view[pos:min(pos + _CHUNK, stop)]), st.config.read_timeout)
        st.metrics.bytes_served.labels(route_label(request)).inc(stop - start)
    await resp.write_eof()
    return resp

