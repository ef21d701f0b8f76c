"""The engine's core cases over every client users run it with: a store opened directly (local
directory or S3 on moto) and the service over HTTP (``LoRAEngine(model, MintClient("http://..."))``,
``follow=True`` riding the HTTP long poll). One parametrized fixture, the same assertions."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_client import LoRAEngine, MintClient
from engine_client.errors import ConnectionFailed, Forbidden, ServiceUnavailable, Unauthorized, VersionDeleted
from mint_store.service import ServerThread, ServiceConfig
from mint_store.service.state import STATE
from tests.support.engine import TENANT
from tests.support.hf_models import ATTN, MLP, build_model, load_peft, logits, make_peft_dir, sample_ids
from tests.support.targets import make_bucket, s3_options

IDS = sample_ids(batch=3, seq=5, seed=11)
TOKENS = {TENANT: "t-writer-token-000001", "u": "u-writer-token-000002"}


@dataclass
class Backend:
    """Where the engine's adapters come from; ``client()`` is what a user would construct."""

    kind: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)
    server: ServerThread | None = None

    def client(self, token: str | None = None) -> MintClient:
        if self.kind == "http":
            return MintClient(self.url, token or TOKENS[TENANT])
        return MintClient(self.url, **self.options)

    def engine(self, token: str | None = None, **options: Any) -> LoRAEngine:
        return LoRAEngine(build_model("llama"), self.client(token), **options)


@pytest.fixture(params=["local", "http", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    store, index = str(tmp_path / "store"), str(tmp_path / "index")
    if request.param == "local":
        yield Backend("local", store, {"index_dir": index})
    elif request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")  # moto starts only for this case
        url = f"s3://{make_bucket(endpoint)}/mint"
        yield Backend("s3", url, {"index_dir": index, "storage_options": s3_options(endpoint)})
    else:
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps({"tokens": [
            {"token": token, "tenants": [tenant], "role": "write"} for tenant, token in TOKENS.items()]}))
        (tmp_path / "uploads").mkdir()
        server = ServerThread(ServiceConfig(store=store, index_dir=index, host="127.0.0.1", port=0, workers=2,
                                            tokens_file=str(tokens), upload_dir=str(tmp_path / "uploads"),
                                            auto_compact=False))
        try:
            yield Backend("http", server.url, server=server)
        finally:
            server.stop()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("clients")
    return {
        "v1": make_peft_dir(tmp / "v1", "llama", r=4, lora_alpha=8, target_modules=ATTN),
        "v2": make_peft_dir(tmp / "v2", "llama", r=4, lora_alpha=2, target_modules=ATTN),  # v1's layout
        "mlp": make_peft_dir(tmp / "mlp", "llama", r=1, lora_alpha=2, target_modules=MLP),  # another layout
    }


@pytest.fixture(scope="module")
def want(dirs: dict[str, Path]) -> dict[str | None, torch.Tensor]:
    out: dict[str | None, torch.Tensor] = {name: logits(load_peft(d, "llama"), IDS) for name, d in dirs.items()}
    out[None] = logits(build_model("llama"), IDS)
    return out


def wait_until(ready: Callable[[], bool]) -> None:
    """Poll a condition another thread makes true (fail after 30 s)."""
    deadline = time.monotonic() + 30
    while not ready():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


def publish(engine: LoRAEngine, dirs: dict[str, Path], name: str, src: str, tag: str | None = None) -> Any:
    """Publish ``dirs[src]`` as ``t/<name>`` through the engine's own client (its backend)."""
    return engine.call(engine.client.publish(TENANT, name, dirs[src], tag=tag))


def wrong_rows(out: Any, want: dict[str | None, torch.Tensor], expected: list[str | None]) -> list[int]:
    """The rows of ``out`` (an output or its logits) that are not PEFT's for their expected adapter."""
    got = out.logits if hasattr(out, "logits") else out
    return [i for i, name in enumerate(expected) if (got[i] - want[name][i]).abs().max().item() > 1e-5]


def test_mixed_batch_equals_peft(backend: Backend, dirs: dict[str, Path],
                                 want: dict[str | None, torch.Tensor]) -> None:
    with backend.engine(slots=2) as engine, torch.no_grad():
        for name in ("v1", "v2", "mlp"):
            publish(engine, dirs, name, name)
        out = engine.forward(IDS, adapters=["t/v1", "t/mlp", None]).logits
        assert wrong_rows(out, want, ["v1", "mlp", None]) == []
        out = engine.forward(IDS, adapters=["t/v2", "t/v1", "t/mlp"]).logits  # two of one layout, one of another
        assert wrong_rows(out, want, ["v2", "v1", "mlp"]) == []
        assert len(engine.pools) == 2 and engine.metrics.count("storage") == 3


def test_lru_churn_through_one_slot(backend: Backend, dirs: dict[str, Path],
                                    want: dict[str | None, torch.Tensor]) -> None:
    with backend.engine(slots=1) as engine, torch.no_grad():
        cids = {name: publish(engine, dirs, name, name).content_id for name in ("v1", "v2")}
        for _ in range(3):
            for name in ("v1", "v2"):
                out = engine.forward(IDS, adapters=[f"t/{name}", None, f"t/{name}"]).logits
                assert wrong_rows(out, want, [name, None, name]) == []
                (pool,) = engine.pools.values()
                assert pool.resident() == [cids[name]]  # the other was evicted from the one slot
        if backend.kind != "local":  # each row was read once; every later switch came from the host cache
            assert engine.metrics.count("storage") == 2 and engine.metrics.count("host") == 4
        else:  # a local store on the CPU: every switch is one read straight into the slot, no host copy
            assert engine.metrics.count("storage") == 6 and engine.metrics.count("host") == 0
            assert engine.streamer.cache_keys() == []


def test_hot_swap_on_a_moved_tag(backend: Backend, dirs: dict[str, Path],
                                 want: dict[str | None, torch.Tensor]) -> None:
    with backend.engine(follow=True, follow_wait=5.0) as engine, torch.no_grad():
        if backend.server is not None:  # following is a long poll asleep in the server's feed
            wait_until(lambda: backend.server.server.app[STATE].feed.parked >= 1)
        publish(engine, dirs, "chat", "v1", tag="prod")
        # the feed has handled that publish: the ref the next batch resolves is kept (an event still in
        # flight would make the engine resolve it again at its next use instead of caching it)
        engine.sync_events()
        refs = ["t/chat:prod", None, "t/chat:prod"]
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v1", None, "v1"]) == []
        publish(engine, dirs, "chat", "v2", tag="prod")
        engine.sync_events()  # the feed (the long poll over HTTP) staged the move and prefetched the row
        reads, swaps = engine.metrics.count("storage"), engine.swaps
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v2", None, "v2"]) == []
        assert engine.swaps == swaps + 1 and engine.metrics.count("storage") == reads  # no read at swap time
        engine.call(engine.client.tag("t/chat@1", "prod"))  # rolled back
        engine.sync_events()
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v1", None, "v1"]) == []


def test_a_deleted_version_is_refused_once_deleted(backend: Backend, dirs: dict[str, Path],
                                                   want: dict[str | None, torch.Tensor]) -> None:
    with backend.engine(follow=True, follow_wait=5.0) as engine, torch.no_grad():
        publish(engine, dirs, "chat", "v1")
        publish(engine, dirs, "chat", "v2")
        assert wrong_rows(engine.forward(IDS, adapters=["t/chat@1", "t/chat", None]), want,
                          ["v1", "v2", None]) == []
        assert engine.call(engine.client.delete("t/chat@1")) == 1
        engine.sync_events()
        with pytest.raises(VersionDeleted):  # not the row the engine still holds in a slot
            engine.forward(IDS, adapters=["t/chat@1", None, None])
        assert wrong_rows(engine.forward(IDS, adapters=[None, "t/chat", "t/chat@2"]), want,
                          [None, "v2", "v2"]) == []


def test_an_unauthorized_token_is_refused(backend: Backend, dirs: dict[str, Path],
                                          want: dict[str | None, torch.Tensor]) -> None:
    if backend.kind != "http":
        pytest.skip("tokens exist only over HTTP; a store opened directly has no caller identity")
    with backend.engine() as writer:
        publish(writer, dirs, "chat", "v1")
    with backend.engine(token="not-a-token-at-all-000") as engine, torch.no_grad(), pytest.raises(Unauthorized):
        engine.forward(IDS, adapters=["t/chat", None, None])
    with backend.engine(token=TOKENS["u"]) as engine, torch.no_grad():  # a valid token of another tenant
        with pytest.raises(Forbidden, match="does not hold tenant 't'"):
            engine.forward(IDS, adapters=["t/chat", None, None])
        assert not engine.pools or all(p.resident() == [] for p in engine.pools.values())
        assert wrong_rows(engine.forward(IDS, adapters=[None] * 3), want, [None] * 3) == []  # still serving


def test_follow_and_stop_following_after_construction(backend: Backend, dirs: dict[str, Path],
                                                      want: dict[str | None, torch.Tensor]) -> None:
    refs = ["t/chat:prod", None, "t/chat:prod"]
    with backend.engine() as engine, torch.no_grad():
        publish(engine, dirs, "chat", "v1", tag="prod")
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v1", None, "v1"]) == []
        with pytest.raises(RuntimeError, match="follow"):
            engine.sync_events()  # not following yet
        engine.follow()
        engine.follow()  # twice is once
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v1", None, "v1"]) == []  # kept fresh from now
        publish(engine, dirs, "chat", "v2", tag="prod")
        engine.sync_events()
        reads = engine.metrics.count("storage")
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v2", None, "v2"]) == []
        assert engine.swaps == 1 and engine.metrics.count("storage") == reads  # staged and prefetched by the feed
        engine.stop_following()
        with pytest.raises(RuntimeError, match="follow"):
            engine.sync_events()
        engine.call(engine.client.tag("t/chat@1", "prod"))
        # without the feed nothing is staged: the next batch resolves the tag again by itself
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v1", None, "v1"]) == []
        assert engine.swaps == 1


def test_a_swap_staged_when_following_stops_is_dropped(backend: Backend, dirs: dict[str, Path],
                                                      want: dict[str | None, torch.Tensor]) -> None:
    """Staged by the feed, not yet applied by a batch, then following stops: applied later, it
    would pin the tag to that version, and with no feed nothing would ever move it again."""
    refs = ["t/chat:prod", None, "t/chat:prod"]
    with backend.engine() as engine, torch.no_grad():
        publish(engine, dirs, "chat", "v1", tag="prod")
        engine.follow()
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v1", None, "v1"]) == []
        publish(engine, dirs, "chat", "v2", tag="prod")
        engine.sync_events()  # v2 staged for the next batch
        engine.stop_following()
        engine.call(engine.client.tag("t/chat@1", "prod"))
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v1", None, "v1"]) == []
        engine.call(engine.client.tag("t/chat@2", "prod"))
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v2", None, "v2"]) == []
        assert engine.swaps == 0


# -- the engine's own entry points (a local store is enough) -------------------------------------


def local_engine(tmp_path: Path, **options: Any) -> LoRAEngine:
    return Backend("local", str(tmp_path / "store"), {"index_dir": str(tmp_path / "index")}).engine(**options)


def test_batch_with_batch_size_routes_the_models_own_calls(tmp_path: Path, dirs: dict[str, Path],
                                                            want: dict[str | None, torch.Tensor]) -> None:
    from engine_client.errors import BatchMismatch

    with local_engine(tmp_path, slots=2) as engine, torch.no_grad():
        for name in ("v1", "mlp"):
            publish(engine, dirs, name, name)
        with engine.batch(["t/v1", None, "t/mlp"], batch_size=3) as ctx:
            assert ctx is not None
            out = engine.model(IDS).logits  # the caller calls the model itself
            with pytest.raises(RuntimeError, match="do not nest"), engine.batch([None] * 3):
                pass
        assert wrong_rows(out, want, ["v1", None, "mlp"]) == []
        assert wrong_rows(engine.model(IDS).logits, want, [None] * 3) == []  # outside a batch: the base model
        with pytest.raises(BatchMismatch, match="2 adapters for a batch of 3"), \
                engine.batch(["t/v1", None], batch_size=3):
            pass
        with pytest.raises(TypeError), engine.batch([1, None, None], batch_size=3):  # type: ignore[list-item]
            pass


def test_forward_from_several_threads_at_once(tmp_path: Path, dirs: dict[str, Path],
                                              want: dict[str | None, torch.Tensor]) -> None:
    import threading

    mixes: list[list[str | None]] = [["v1", "mlp", None], ["v2", None, "v1"], [None, "v2", "mlp"], ["mlp", "v1", "v2"]]
    with local_engine(tmp_path, slots=2) as engine, torch.no_grad():
        for name in ("v1", "v2", "mlp"):
            publish(engine, dirs, name, name)
        start = threading.Barrier(len(mixes))
        bad: list[Any] = []

        def worker(mix: list[str | None]) -> None:
            try:
                start.wait()
                for _ in range(3):
                    out = engine.forward(IDS, adapters=[None if n is None else f"t/{n}" for n in mix])
                    if wrong_rows(out, want, mix):
                        bad.append((mix, wrong_rows(out, want, mix)))
            except BaseException as e:  # reported below
                bad.append(e)

        threads = [threading.Thread(target=worker, args=(mix,)) for mix in mixes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert bad == []
        assert all(p.available() == p.slots for p in engine.pools.values())  # every batch gave its pins back


# -- a feed that fails: moving refs must never stay pinned to what the engine last saw ------------


REFS_PROD = ["t/chat:prod", None, "t/chat:prod"]


@contextmanager
def _following_v1(tmp_path: Path, dirs: dict[str, Path], want: dict[str | None, torch.Tensor]) -> Iterator[LoRAEngine]:
    """A local engine following the feed, t/chat:prod = v1 published and served once (cached)."""
    with local_engine(tmp_path) as engine, torch.no_grad():
        publish(engine, dirs, "chat", "v1", tag="prod")
        engine.follow()
        assert wrong_rows(engine.forward(IDS, adapters=REFS_PROD), want, ["v1", None, "v1"]) == []
        yield engine


def test_a_follow_that_cannot_start_changes_nothing(tmp_path: Path, dirs: dict[str, Path],
                                                    want: dict[str | None, torch.Tensor],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    refs = ["t/chat:prod", None, "t/chat:prod"]
    with local_engine(tmp_path) as engine, torch.no_grad():
        publish(engine, dirs, "chat", "v1", tag="prod")

        async def down(*args: Any, **kwargs: Any) -> Any:
            raise ConnectionFailed("the service is down")

        with monkeypatch.context() as m:
            m.setattr(engine.client, "events", down)
            with pytest.raises(ConnectionFailed):
                engine.follow()
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v1", None, "v1"]) == []
        publish(engine, dirs, "chat", "v2", tag="prod")  # no follower saw this: the next batch must resolve
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v2", None, "v2"]) == []
        engine.follow()  # and it can still start once the feed answers
        engine.sync_events()


def test_a_follower_stopped_by_an_error_falls_back_to_resolving(tmp_path: Path, dirs: dict[str, Path],
                                                                want: dict[str | None, torch.Tensor],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    refs = REFS_PROD
    with _following_v1(tmp_path, dirs, want) as engine, torch.no_grad():
        events = engine.client.events

        async def revoked(after: int, **kwargs: Any) -> Any:  # the feed's head still answers; waiting does not
            if kwargs.get("limit") == 0:
                return await events(after, **kwargs)
            raise Unauthorized("token revoked")

        monkeypatch.setattr(engine.client, "events", revoked)
        publish(engine, dirs, "chat", "v2", tag="prod")  # wakes the follower; its next poll is refused
        wait_until(lambda: not engine._feed.running)
        with pytest.raises(RuntimeError, match="stopped"):
            engine.sync_events()
        engine.call(engine.client.tag("t/chat@1", "prod"))  # no feed moves it now: each batch resolves it
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v1", None, "v1"]) == []
        engine.call(engine.client.tag("t/chat@2", "prod"))
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v2", None, "v2"]) == []
        monkeypatch.setattr(engine.client, "events", events)
        engine.follow()  # follow() again resumes
        engine.sync_events()


def test_an_event_whose_refs_cannot_be_resolved_forgets_them(tmp_path: Path, dirs: dict[str, Path],
                                                             want: dict[str | None, torch.Tensor],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    refs = REFS_PROD
    with _following_v1(tmp_path, dirs, want) as engine, torch.no_grad():
        resolve_many = engine.client.resolve_many
        failures = []

        async def flaky(*args: Any, **kwargs: Any) -> Any:
            if not failures:
                failures.append(1)
                raise ServiceUnavailable("restarting")
            return await resolve_many(*args, **kwargs)

        monkeypatch.setattr(engine.client, "resolve_many", flaky)
        publish(engine, dirs, "chat", "v2", tag="prod")
        engine.sync_events()
        assert failures == [1]  # the follower's resolve of the moved tag failed
        # the ref it could not re-resolve is forgotten, not kept at v1: the batch resolves it
        assert wrong_rows(engine.forward(IDS, adapters=refs), want, ["v2", None, "v2"]) == []


def test_an_engine_that_fails_to_start_leaves_nothing_behind(want: dict[str | None, torch.Tensor]) -> None:
    """A constructor that raises (here: following a service that is down) must not leave the
    model wrapped, its I/O thread running, or the client it opened."""
    import gc
    import threading

    def io_threads() -> int:
        return sum(t.name == "mint-engine-io" and t.is_alive() for t in threading.enumerate())

    before = io_threads()
    model = build_model("llama")
    for _ in range(3):
        with pytest.raises(ConnectionFailed):
            LoRAEngine(model, "http://127.0.0.1:1", follow=True, client_options={"retries": 0})
    gc.collect()
    assert io_threads() == before
    assert not any("forward" in m.__dict__ or m._forward_hooks for m in model.modules())  # unwrapped
    with torch.no_grad():
        assert wrong_rows(logits(model, IDS), want, [None] * 3) == []
