"""TagFollower: names a vLLM server holds are dropped exactly when the store changes what they name.

The store and the service are real; ``drop`` stands where vLLM's unload route is (the
real route is exercised in tests_vllm/test_serve.py) and records what it was asked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine_client import SyncMintClient
from engine_client.vllm_plugin import MintResolver
from engine_client.vllm_plugin.follower import TagFollower, affected, own_server_url
from engine_client.vllm_plugin.preload import ServerLoRA
from engine_client.vllm_plugin.resolver import AdapterUnavailable
from mint_store.peft.directory import load_peft_dir
from mint_store.service import ServerThread
from mint_store.store import Store
from tests.support.vllm_plugin import BASE, MODEL, ResolverFactory

LIVENESS = 30.0  # seconds a follower may take before the test calls it stuck (not a performance bound)


class Drops:
    """Records drop(name) calls; ``wait_for`` blocks until a name was dropped."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._cond = threading.Condition()

    def __call__(self, name: str) -> None:
        with self._cond:
            self.names.append(name)
            self._cond.notify_all()

    def wait_for(self, name: str, times: int = 1) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.names.count(name) >= times, LIVENESS), (name, self.names)


@pytest.fixture
def followers() -> Iterator[list[TagFollower]]:
    """Followers made by a test, stopped before their resolvers close."""
    made: list[TagFollower] = []
    yield made
    for f in made:
        f.stop()


def _follow(resolver: MintResolver, drops: Drops, followers: list[TagFollower],
            head: Callable[[], int] | None = None, *, release: bool = False,
            warm: Callable[[str, str], None] | None = None) -> TagFollower:
    client = resolver.client
    f = TagFollower(resolver.current, head or (lambda: client.events(0, limit=0).head),
                    lambda after: client.follow(after, wait=5.0), drops,
                    release=resolver.release if release else None, warm=warm)
    followers.append(f)
    return f


def _serve(resolver: MintResolver, follower: TagFollower, name: str) -> str:
    """What the plugin does on a resolve: resolve, track the content the server now holds,
    look once more (resolve_tracked)."""
    got = resolver.resolve_tracked(MODEL, name, follower)
    assert got is not None and follower.held()[name] == got.content_id
    return got.content_id


@pytest.fixture
def published(server: ServerThread, publisher: SyncMintClient, peft_dirs: list[Path]) -> list[str]:
    """acme/x @1 = a (tag prod), @2 = b; acme/y @1 = c (tag prod)."""
    out = [publisher.publish("acme", "x", load_peft_dir(peft_dirs[0], base=BASE), tag="prod").content_id,
           publisher.publish("acme", "x", load_peft_dir(peft_dirs[1], base=BASE)).content_id,
           publisher.publish("acme", "y", load_peft_dir(peft_dirs[2], base=BASE), tag="prod").content_id]
    return out


def test_a_moved_tag_and_a_rollback_drop_the_tag_but_never_a_pinned_version(
        server: ServerThread, publisher: SyncMintClient, published: list[str], make_resolver: ResolverFactory,
        followers: list[TagFollower]) -> None:
    a, b, c = published
    resolver = make_resolver(server.url)
    drops = Drops()
    follower = _follow(resolver, drops, followers)
    assert _serve(resolver, follower, "acme/x:prod") == a
    assert _serve(resolver, follower, "acme/x@1") == a
    assert _serve(resolver, follower, "acme/y:prod") == c
    assert _serve(resolver, follower, f"sha:{a}") == a

    publisher.tag("acme/x@2", "prod")
    drops.wait_for("acme/x:prod")
    assert follower.held() == {"acme/x@1": a, "acme/y:prod": c, f"sha:{a}": a}
    assert _serve(resolver, follower, "acme/x:prod") == b  # the next request resolves it again

    publisher.tag("acme/x@1", "prod")  # rollback
    drops.wait_for("acme/x:prod", times=2)
    assert _serve(resolver, follower, "acme/x:prod") == a
    assert drops.names == ["acme/x:prod", "acme/x:prod"]  # @1, sha: and another adapter's tag untouched


def test_a_moved_tag_is_loaded_with_its_new_content_before_the_switch_and_kept(
        server: ServerThread, publisher: SyncMintClient, published: list[str], make_resolver: ResolverFactory,
        followers: list[TagFollower]) -> None:
    """The preload path (preload.py): what a held name moved to is loaded while the old content
    is still held, then the name switched to it: tracked as the new content, never dropped. A
    warm-up that fails (or cannot switch) drops the name, so the next request resolves it."""
    a, b, _ = published
    resolver = make_resolver(server.url)
    drops = Drops()
    order: list[tuple[str, str, str]] = []

    def warm(name: str, content_id: str) -> bool:
        order.append(("warm", name, follower.held()[name]))  # (still the old content meanwhile)
        if content_id == a:
            raise RuntimeError("this warm-up fails")
        got = resolver.resolve(MODEL, f"sha:{content_id}")  # what the plugin loads under the name
        return got is not None and got.content_id == content_id

    follower = _follow(resolver, drops, followers, warm=warm)
    assert _serve(resolver, follower, "acme/x:prod") == a
    publisher.tag("acme/x@2", "prod")
    deadline = time.monotonic() + LIVENESS
    while follower.held().get("acme/x:prod") != b:
        assert time.monotonic() < deadline, (order, follower.held())
        time.sleep(0.05)
    assert order == [("warm", "acme/x:prod", a)] and drops.names == []  # loaded while a was held; not dropped
    publisher.tag("acme/x@1", "prod")  # its warm-up fails: dropped, resolved again by the next request
    drops.wait_for("acme/x:prod")
    assert order[-1] == ("warm", "acme/x:prod", b) and "acme/x:prod" not in follower.held()
    assert _serve(resolver, follower, "acme/x:prod") == a


def test_content_no_held_name_names_is_released_from_the_cache(
        server: ServerThread, publisher: SyncMintClient, published: list[str], make_resolver: ResolverFactory,
        followers: list[TagFollower]) -> None:
    """The cache holds (never evicts) what the server may reload from disk; once every name of a
    content was dropped, nothing will, and it is released (kept forever, a trainer publishing
    every few steps to a followed tag filled the disk past MINT_VLLM_CACHE_BYTES)."""
    a, b, _ = published
    resolver = make_resolver(server.url)
    drops = Drops()
    follower = _follow(resolver, drops, followers, release=True)
    cache = resolver._parts()[1]
    assert _serve(resolver, follower, "acme/x:prod") == a
    assert _serve(resolver, follower, "acme/x@1") == a
    publisher.tag("acme/x@2", "prod")
    drops.wait_for("acme/x:prod")
    assert a in cache.held()  # acme/x@1 still names it
    assert _serve(resolver, follower, "acme/x:prod") == b
    publisher.delete("acme/x@1")
    drops.wait_for("acme/x@1")
    for _ in range(3000):
        if a not in cache.held():
            break
        threading.Event().wait(0.01)
    assert cache.held() == {b}


def test_content_a_resolution_in_flight_leased_is_not_released_under_it(
        server: ServerThread, publisher: SyncMintClient, published: list[str], make_resolver: ResolverFactory,
        followers: list[TagFollower], monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache lease of a name being resolved is taken before the name is tracked: a drop of
    another name of the same content in that window released it, and the entry could be evicted
    under the name about to be served. Releases wait for resolutions in flight."""
    a = published[0]
    resolver = make_resolver(server.url)
    drops = Drops()
    follower = _follow(resolver, drops, followers, release=True)
    cache = resolver._parts()[1]
    assert _serve(resolver, follower, "acme/x:prod") == a
    leased, go = threading.Event(), threading.Event()
    real = resolver.resolve

    def paused(base: str, name: str) -> object:  # the real resolve; then a pause before it is tracked
        got = real(base, name)
        if name == "acme/x@1":
            leased.set()
            go.wait(LIVENESS)
        return got

    monkeypatch.setattr(resolver, "resolve", paused)
    pinned = threading.Thread(target=resolver.resolve_tracked, args=(MODEL, "acme/x@1", follower))
    pinned.start()
    assert leased.wait(LIVENESS)
    publisher.tag("acme/x@2", "prod")  # drops acme/x:prod, the only name tracked to a so far
    drops.wait_for("acme/x:prod")
    go.set()
    pinned.join(LIVENESS)
    assert follower.held()["acme/x@1"] == a and a in cache.held()


def test_latest_moves_on_publish_and_deleted_versions_are_dropped(
        server: ServerThread, publisher: SyncMintClient, published: list[str], peft_dirs: list[Path],
        make_resolver: ResolverFactory, followers: list[TagFollower]) -> None:
    a, b, _ = published
    resolver = make_resolver(server.url)
    drops = Drops()
    follower = _follow(resolver, drops, followers)
    assert _serve(resolver, follower, "acme/x") == b
    assert _serve(resolver, follower, "acme/x@1") == a
    assert _serve(resolver, follower, "acme/x:prod") == a

    publisher.publish("acme", "x", load_peft_dir(peft_dirs[2], base=BASE))  # a new latest
    drops.wait_for("acme/x")
    assert drops.names == ["acme/x"]

    publisher.delete("acme/x@1")  # deletes what prod and @1 name
    drops.wait_for("acme/x@1")
    drops.wait_for("acme/x:prod")
    assert resolver.resolve(MODEL, "acme/x@1") is None


def test_a_quarantined_row_is_dropped(store: Store, peft_dirs: list[Path], make_resolver: ResolverFactory,
        followers: list[TagFollower]) -> None:
    got = store.publish("acme", "x", load_peft_dir(peft_dirs[0], base=BASE), tag="prod")
    resolver = make_resolver(str(store.storage.root))
    drops = Drops()
    follower = _follow(resolver, drops, followers)
    assert _serve(resolver, follower, "acme/x@1") == got.content_id
    store.quarantine([got.content_id])
    drops.wait_for("acme/x@1")
    assert resolver.current("acme/x@1") is None
    # resolved again (vLLM's next request): refused, not served from the cached copy
    for name in ("acme/x@1", "acme/x:prod", "acme/x"):
        with pytest.raises(AdapterUnavailable, match=r"damaged|quarantined"):
            resolver.resolve(MODEL, name)


def test_a_tag_moved_while_its_name_is_resolved_is_resolved_again(
        server: ServerThread, publisher: SyncMintClient, published: list[str], make_resolver: ResolverFactory,
        followers: list[TagFollower]) -> None:
    """The move comes after the resolve read the tag and before the name was tracked: no event
    is left for the follower to see, so the resolve looks once more and takes the new content."""
    a, b, _ = published
    resolver = make_resolver(server.url)
    follower = _follow(resolver, Drops(), followers)
    _serve(resolver, follower, "acme/y:prod")  # the feed loop runs from here on
    resolve = resolver.resolve
    calls = []

    def move_during(model: str, name: str) -> object:
        got = resolve(model, name)
        if not calls:
            publisher.tag("acme/x@2", "prod")  # after the lookup of @1, before track()
        calls.append(got)
        return got

    resolver.resolve = move_during  # type: ignore[method-assign]
    assert _serve(resolver, follower, "acme/x:prod") == b and len(calls) == 2
    assert calls[0].content_id == a


def test_affected_names_per_event_kind() -> None:
    c1, c2, c3 = "1" * 32, "2" * 32, "3" * 32
    held = {"t/a:prod": c1, "t/a@1": c1, "t/a": c2, "t/b:prod": c3, f"sha:{c1}": c1}
    assert affected({"kind": "tag", "tenant": "t", "name": "a", "tag": "prod"}, held) == ["t/a:prod", "t/a"]
    assert affected({"kind": "publish", "items": [{"tenant": "t", "name": "b"}]}, held) == ["t/b:prod"]
    assert sorted(affected({"kind": "delete", "tenant": "t", "name": "a", "version": 1}, held)) == \
        [f"sha:{c1}", "t/a", "t/a:prod", "t/a@1"]
    assert sorted(affected({"kind": "quarantine", "content_ids": [c1]}, held)) == [f"sha:{c1}", "t/a:prod", "t/a@1"]
    assert affected({"kind": "compact", "content_ids": [c1]}, held) == []


def test_a_change_before_the_feed_starts_is_caught_up(
        server: ServerThread, publisher: SyncMintClient, published: list[str], make_resolver: ResolverFactory,
        followers: list[TagFollower]) -> None:
    """A tag that moved between the resolve and the follower's start has no event after the
    follower's position: the follower rechecks what it holds when it starts."""
    a, _, _ = published
    resolver = make_resolver(server.url)
    drops = Drops()
    client = resolver.client
    started = threading.Event()

    def head() -> int:
        started.wait(LIVENESS)  # the feed starts only after the move below
        return client.events(0, limit=0).head

    follower = _follow(resolver, drops, followers, head)
    assert _serve(resolver, follower, "acme/x:prod") == a
    publisher.tag("acme/x@2", "prod")
    started.set()
    drops.wait_for("acme/x:prod")


def test_own_server_url_from_the_command_line() -> None:
    assert own_server_url(["api_server", "--model", "m", "--port", "8123"]) == "http://127.0.0.1:8123"
    assert own_server_url(["vllm", "serve", "m", "--host=0.0.0.0"]) == "http://127.0.0.1:8000"
    assert own_server_url(["x", "--host", "::1", "--port", "9", "--ssl-keyfile", "k"]) == "https://[::1]:9"


def test_unloader_treats_an_unknown_name_as_dropped_and_reports_other_refusals(tmp_path: Path) -> None:
    from aiohttp import web

    seen: list[tuple[str, str | None]] = []

    async def unload(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((body["lora_name"], request.headers.get("Authorization")))
        if body["lora_name"] == "gone":
            return web.json_response({"error": "not found"}, status=404)
        if body["lora_name"] == "bad":
            return web.json_response({"error": "nope"}, status=500)
        return web.Response(text="Success")

    server = _AppThread(unload)
    try:
        drop = ServerLoRA(server.url, api_key="k1").unload
        drop("acme/x:prod")
        drop("gone")
        with pytest.raises(RuntimeError, match="refused to unload 'bad': 500"):
            drop("bad")
    finally:
        server.stop()
    assert seen == [("acme/x:prod", "Bearer k1"), ("gone", "Bearer k1"), ("bad", "Bearer k1")]


class _AppThread:
    """A one-route aiohttp app on loopback, in a thread."""

    def __init__(self, handler: object) -> None:
        import asyncio

        from aiohttp import web

        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/unload_lora_adapter", handler)  # type: ignore[arg-type]
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
