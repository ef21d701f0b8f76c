"""The store's behaviour, on a local directory and on S3 (moto) alike."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from mint_store.errors import (
    AdapterNotFound,
    BaseMismatch,
    BlobNotFound,
    Conflict,
    IntegrityError,
    InvalidAdapter,
    InvalidName,
    ReadOnlyStore,
    TagNotFound,
    VersionDeleted,
    VersionNotFound,
)
from mint_store.format.adapter import make_adapter
from mint_store.format.hashing import content_id
from mint_store.format.layout import encode_rows
from mint_store.maintenance.reindex import rebuild_index
from mint_store.storage import open_storage
from tests.support.factories import corrupt_byte, random_adapter
from tests.support.targets import StoreTarget


def snapshot(store) -> tuple:
    """Everything a client can observe, for before/after comparisons."""
    versions = [v.to_dict() for v in store.iter_versions()]
    objects = store.storage.list("")
    return store.last_seq, versions, objects


def test_publish_resolve_read_every_ref_form(target: StoreTarget) -> None:
    with target.open() as store:
        a = random_adapter(1)
        r = store.publish("acme", "chat", a, tag="prod")
        assert (r.version, r.deduplicated) == (1, False)
        for ref in ("acme/chat", "acme/chat@1", "acme/chat:prod", f"sha:{r.content_id}"):
            loc = store.resolve(ref)
            assert loc.content_id == r.content_id
            _, row = store.read(ref)
            assert content_id(loc.layout_id, row) == r.content_id
        back = store.load("acme/chat")
        for m0, m1 in zip(a.modules, back.modules, strict=True):
            assert m0.name == m1.name and m0.scaling == m1.scaling
            assert torch.equal(m0.a, m1.a) and torch.equal(m0.b, m1.b)


def test_offset_read_equals_zarr_read(target: StoreTarget) -> None:
    with target.open() as store:
        results = store.publish_many([("acme", f"n{i}", random_adapter(i)) for i in range(7)])
        for r in results:
            loc = store.resolve(f"acme/{r.name}")
            row = store.read_row(loc)
            np.testing.assert_array_equal(row, store.read_row_zarr(loc))
            buf = bytearray(loc.length + 100)  # a caller buffer larger than the row
            store.read_row(loc, buf)
            assert bytes(buf[: loc.length]) == row.tobytes()


def test_versions_tags_delete(target: StoreTarget) -> None:
    with target.open() as store:
        for i in range(3):
            assert store.publish("acme", "m", random_adapter(10 + i)).version == i + 1
        assert store.tag("acme/m@2", "prod") == 2
        assert store.resolve("acme/m:prod") == store.resolve("acme/m@2")
        assert store.tag("acme/m", "prod") == 3  # moves atomically
        assert store.version("acme/m@3").tags == ("prod",)
        assert store.version("acme/m@2").tags == ()
        assert store.delete("acme/m@3") == 3
        # deleting a version drops tags that pointed at it; latest falls back
        with pytest.raises(TagNotFound):
            store.resolve("acme/m:prod")
        assert store.resolve("acme/m").content_id == store.version("acme/m@2").content_id
        with pytest.raises(VersionDeleted):
            store.resolve("acme/m@3")
        with pytest.raises(VersionDeleted):
            store.tag("acme/m@3", "canary")
        with pytest.raises(VersionDeleted):
            store.delete("acme/m@3")
        # versions are never reused
        assert store.publish("acme", "m", random_adapter(99)).version == 4
        with pytest.raises(VersionNotFound):
            store.resolve("acme/m@9")
        with pytest.raises(AdapterNotFound):
            store.resolve("acme/nope")
        store.untag("acme", "m", "prod") if store.version("acme/m@4").tags else None
        assert [v.version for v in store.versions("acme", "m")] == [1, 2, 3, 4]
        assert [v.deleted for v in store.versions("acme", "m")] == [False, False, True, False]
        # a page at a time: versions above a cursor, at most a limit
        assert [v.version for v in store.versions("acme", "m", limit=2)] == [1, 2]
        assert [v.version for v in store.versions("acme", "m", after=2, limit=2)] == [3, 4]
        assert [v.version for v in store.versions("acme", "m", after=3)] == [4]
        assert store.versions("acme", "m", after=4) == []
        with pytest.raises(ValueError, match="limit"):
            store.versions("acme", "m", limit=0)


def test_dedup_stores_identical_content_once(target: StoreTarget) -> None:
    with target.open() as store:
        a = random_adapter(5)
        r1 = store.publish("acme", "x", a)
        objects = store.storage.list("packs/")
        r2 = store.publish("acme", "y", random_adapter(5))
        r3 = store.publish("other", "x", a)
        # the row is shared, but only a tenant's own bytes are reported as deduplicated
        assert r2.deduplicated and not r3.deduplicated
        assert r1.content_id == r2.content_id == r3.content_id
        assert store.storage.list("packs/") == objects  # no new shard
        # every reference gone, then the same bytes again: the stored row comes back to life
        for ref in ("acme/x", "acme/y", "other/x"):
            store.delete(ref)
        with pytest.raises(BlobNotFound):
            store.resolve(f"sha:{r1.content_id}")
        r4 = store.publish("acme", "z", a)
        assert not r4.deduplicated and store.storage.list("packs/") == objects  # acme held none any more
        assert store.resolve(f"sha:{r1.content_id}").content_id == r1.content_id


def test_concurrent_publishes_of_one_name_get_distinct_versions(target: StoreTarget) -> None:
    with target.open() as store:
        results = []
        lock = threading.Lock()

        def worker(i: int) -> None:
            r = store.publish("acme", "same", random_adapter(100 + i))
            with lock:
                results.append(r)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(r.version for r in results) == list(range(1, 17))


def test_group_commit_shares_one_shard_log_and_transaction(target: StoreTarget) -> None:
    with target.open() as store:
        batches: list[int] = []
        store.add_batch_listener(batches.append)
        with store.held_commits():
            futs = [store.publish_async("acme", f"g{i}", random_adapter(200 + i)) for i in range(20)]
        results = [f.result() for f in futs]
        assert batches == [20]
        assert {r.seq for r in results} == {1}
        assert len(store.storage.list("log/")) == 1
        shards = {store.resolve(f"acme/g{i}").shard_key for i in range(20)}
        assert len(shards) == 1


def test_new_commits_never_rewrite_a_shard(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        first = {k: store.storage.get(k) for k in store.storage.list("packs/") if "/c/" in k}
        for i in range(5):
            store.publish("acme", f"b{i}", random_adapter(2 + i))
        for k, data in first.items():
            assert store.storage.get(k) == data
        shards = [store.resolve(f"acme/b{i}").shard_key for i in range(5)]
        assert len(set(shards)) == 5 and not set(shards) & set(first)


def test_bulk_publish_rows(target: StoreTarget) -> None:
    with target.open() as store:
        proto = random_adapter(0)
        layout = proto.layout
        n = 50
        g = torch.Generator().manual_seed(3)
        stacked = {k: torch.randn((n, *v.shape), generator=g).to(v.dtype) for k, v in proto.state_dict().items()}
        rows = encode_rows(layout, stacked, n)
        results = store.publish_rows([("bulk", f"a{i}") for i in range(n)], layout, rows)
        for i, r in enumerate(results):
            _, row = store.read(f"bulk/a{i}")
            np.testing.assert_array_equal(row, rows[i])
            assert r.content_id == content_id(layout.layout_id, rows[i])
        bad = rows[:2].copy()
        bad[1, :4] = np.frombuffer(np.float32(np.nan).tobytes(), dtype=np.uint8)
        seq = store.last_seq
        with pytest.raises(InvalidAdapter, match="NaN or Inf"):
            store.publish_rows([("bulk", "c0"), ("bulk", "c1")], layout, bad)
        assert store.last_seq == seq


def test_moe_and_bf16_adapters_round_trip(target: StoreTarget) -> None:
    with target.open() as store:
        a = random_adapter(7, experts=4, dtype=torch.bfloat16, rank=3)
        store.publish("acme", "moe", a)
        back = store.load("acme/moe")
        moe = [m for m in back.modules if m.experts]
        assert len(moe) == 2 and moe[0].a.shape == (4, 3, 32) and moe[0].b.shape == (4, 64, 3)
        for m0, m1 in zip(a.modules, back.modules, strict=True):
            assert m1.a.dtype == torch.bfloat16 and torch.equal(m0.a, m1.a) and torch.equal(m0.b, m1.b)


def test_large_row_uses_column_chunks_and_reads_in_one_call(target: StoreTarget) -> None:
    with target.open() as store:
        g = torch.Generator().manual_seed(1)
        a = make_adapter({"model.big": (torch.randn(8, 300_000, generator=g), torch.randn(16, 8, generator=g), 1.0)})
        r = store.publish("acme", "big", a)
        assert r.nbytes > 8 * 2**20
        loc = store.resolve("acme/big")
        np.testing.assert_array_equal(store.read_row(loc), store.read_row_zarr(loc))


def test_bad_names_are_refused_and_change_nothing(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish("acme", "ok", random_adapter(1))
        before = snapshot(store)
        for tenant, name in [("acme", ".."), ("..", "x"), ("acme", "a/b"), ("acme", ""), ("Acme", "x"),
                             ("acme", "ｘ"), ("acme", "a" * 65), ("acme", "%2e%2e"), ("acme", "x..y")]:
            with pytest.raises(InvalidName):
                store.publish(tenant, name, random_adapter(2))
        with pytest.raises(InvalidName):
            store.tag("acme/ok", "../prod")
        with pytest.raises(InvalidName):
            store.resolve("acme/ok@0")
        with pytest.raises(InvalidName):
            store.resolve("acme/ok@x")
        assert snapshot(store) == before


def test_base_registration_checks_shapes(target: StoreTarget) -> None:
    with target.open() as store:
        shapes = {f"model.layers.{i}.self_attn.{m}": [32, 32] for i in range(2)
                  for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
        store.register_base("tiny", shapes)
        store.register_base("tiny", shapes)  # idempotent
        with pytest.raises(Conflict):
            store.register_base("tiny", {"model.x": [1, 2]})
        store.publish("acme", "fits", random_adapter(1))
        before = snapshot(store)
        with pytest.raises(BaseMismatch, match=r"model\.layers\.0\.self_attn\.k_proj"):
            store.publish("acme", "wide", random_adapter(1, hidden=48))
        with pytest.raises(BaseMismatch, match="not a module"):
            store.publish("acme", "moe", random_adapter(1, experts=2))
        assert snapshot(store) == before
        assert store.base("tiny")["model.layers.0.self_attn.q_proj"] == [32, 32]


def test_corrupted_bytes_raise_a_typed_error_naming_adapter_and_shard(target: StoreTarget) -> None:
    with target.open() as store:
        r = store.publish("acme", "c", random_adapter(1))
        loc = store.resolve("acme/c")
        corrupt_byte(store.storage, loc.shard_key, loc.offset + 10)
        with pytest.raises(IntegrityError) as e:
            store.read("acme/c")
        assert r.content_id in str(e.value) and loc.shard_key in str(e.value)


def test_reopen_and_reindex_answer_the_same(target: StoreTarget) -> None:
    store = target.open()
    for i in range(6):
        store.publish("acme", f"a{i % 2}", random_adapter(i), tag="prod" if i == 4 else None)
    store.publish("beta", "z", random_adapter(1))  # dedup of acme/a1@1
    store.delete("acme/a1@2")
    store.register_base("other-base", {"model.x": [2, 2]})

    def answers(s) -> tuple:
        refs = ["acme/a0", "acme/a1", "acme/a0:prod", "acme/a0@1", "beta/z"]
        return (snapshot(s)[:2], [s.resolve(r) for r in refs], s.names("acme"), s.tenants(), s.events(0),
                s.base("other-base"))

    before = answers(store)
    store.close()
    with target.open() as store:
        assert answers(store) == before
    rebuild_index(open_storage(target.url, storage_options=target.storage_options), target.index_dir)
    with target.open() as store:
        assert answers(store) == before
        store.publish("acme", "after", random_adapter(50))  # the rebuilt index takes writes


def test_readonly_store_reads_but_refuses_writes(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish("acme", "r", random_adapter(1))
        ro = target.open(readonly=True)
        try:
            assert ro.resolve("acme/r") == store.resolve("acme/r")
            with pytest.raises(ReadOnlyStore):
                ro.publish("acme", "w", random_adapter(2))
        finally:
            ro.close()


def test_resolve_many_reports_errors_in_place(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        out = store.resolve_many(["acme/a", "acme/missing", "acme/a@1", "bad ref"])
        assert out[0] == out[2]
        assert isinstance(out[1], AdapterNotFound) and isinstance(out[3], InvalidName)


def test_listing_pages(target: StoreTarget) -> None:
    with target.open() as store:
        store.publish_many([("acme", f"n{i:02d}", random_adapter(i)) for i in range(12)])
        store.publish("acme", "other", random_adapter(99))
        page1 = store.names("acme", limit=5)
        page2 = store.names("acme", after=page1[-1], limit=100)
        assert page1 + page2 == sorted([f"n{i:02d}" for i in range(12)] + ["other"])
        assert store.names("acme", prefix="n1") == ["n10", "n11"]


def test_lost_shard_is_healed_by_publishing_the_same_content(target: StoreTarget) -> None:
    with target.open() as store:
        r1 = store.publish("acme", "a", random_adapter(1))
        store.publish("acme", "b", random_adapter(1))  # a second reference to the same row
        loc = store.resolve("acme/a")
        store.storage.delete(loc.shard_key)
        from mint_store.errors import StaleLocation

        with pytest.raises(StaleLocation):
            store.read("acme/a")
        r3 = store.publish("acme", "c", random_adapter(1))
        assert r3.content_id == r1.content_id and not r3.deduplicated  # the bytes were written again
        for ref in ("acme/a", "acme/b", "acme/c"):
            _, row = store.read(ref)
            np.testing.assert_array_equal(row, random_adapter(1).to_row()[1])
        store.delete("acme/a")
        store.delete("acme/b")
        assert store.resolve(f"sha:{r1.content_id}").shard_key != loc.shard_key  # one reference left


def test_bulk_publish_is_all_or_nothing(target: StoreTarget) -> None:
    with target.open() as store:
        store.register_base("tiny", {f"model.layers.{i}.self_attn.{m}": [32, 32] for i in range(2)
                                     for m in ("q_proj", "k_proj", "v_proj", "o_proj")})
        good, bad = random_adapter(1), random_adapter(2, hidden=48)  # bad does not fit the base
        before = snapshot(store)
        with store.held_commits():
            f_ok = store.publish_async("acme", "alone", random_adapter(3))
            layout_ok, rows_ok = good.layout, good.to_row()[1][None]
            layout_bad, rows_bad = bad.layout, bad.to_row()[1][None]
        assert f_ok.result().version == 1
        before = snapshot(store)
        import concurrent.futures as cf

        from mint_store.index.commit_log import LOG_PREFIX

        queued = store._writer.queue  # never task_done(): unfinished_tasks counts every submission
        submitted = queued.unfinished_tasks
        with cf.ThreadPoolExecutor(3) as ex, store.held_commits():
            a = ex.submit(store.publish_rows, [("acme", "g1")], layout_ok, rows_ok)
            b = ex.submit(store.publish_rows, [("acme", "b1")], layout_bad, rows_bad)
            c = ex.submit(store.publish_rows, [("acme", "g2"), ("acme", "g3")], layout_ok,
                          np.stack([random_adapter(4).to_row()[1], random_adapter(5).to_row()[1]]))
            while queued.unfinished_tasks < submitted + 3:  # all three bundles wait behind the gate
                cf.wait([a, b, c], timeout=0.005)
                assert not any(f.done() for f in (a, b, c))
        with pytest.raises(BaseMismatch):
            b.result()
        # the refused bundle shared the good ones' commit and did not spoil it: one seq, one log object
        (r1,), (r2, r3) = a.result(), c.result()
        assert r1.version == r2.version == r3.version == 1
        assert r1.seq == r2.seq == r3.seq == before[0] + 1 == store.last_seq
        new_objects = set(snapshot(store)[2]) - set(before[2])
        assert [k for k in new_objects if k.startswith(LOG_PREFIX)] == [f"{LOG_PREFIX}{r1.seq:020d}.json"]
        assert [v.name for v in store.iter_versions()] == ["alone", "g1", "g2", "g3"]


def test_a_config_json_cannot_hold_is_refused_alone_and_int_keys_are_stored_as_the_log_holds_them(
        target: StoreTarget) -> None:
    from dataclasses import replace

    with target.open() as store:
        bad = replace(random_adapter(1), peft_config={"target_modules": {"q_proj", "v_proj"}})  # a set
        with pytest.raises(InvalidAdapter, match="not JSON"):
            store.publish("acme", "bad", bad)
        with pytest.raises(InvalidAdapter, match="not JSON"):
            store.publish("acme", "bad", replace(bad, peft_config={"r": float("nan")}))
        # the writer is healthy: the next publish commits
        assert store.publish("acme", "ok", random_adapter(2)).version == 1
        keyed = replace(random_adapter(3), peft_config={"r": 2, "rank_pattern": {0: 4}})
        assert store.publish("acme", "keyed", keyed).version == 1
        assert store.version("acme/keyed").peft_config == {"r": 2, "rank_pattern": {"0": 4}}
        store.delete("acme/ok")  # later commits of the name's tenant still apply
    with target.open() as store:  # replayed from the log, the same record
        assert store.version("acme/keyed").peft_config == {"r": 2, "rank_pattern": {"0": 4}}
        assert [v.deleted for v in store.versions("acme", "ok")] == [True]
        with pytest.raises(AdapterNotFound):
            store.resolve("acme/bad")


def test_a_publish_cancelled_by_its_caller_while_the_writer_answers_it_is_not_a_failure() -> None:
    """The caller's cancel can land between the writer's done() check and its set_result (a
    request deadline cancels the future): the writer's answer must not raise (it was taken for
    a failed commit, and the batch's other, durable, publishes were failed with it)."""
    from concurrent.futures import Future

    from mint_store.write.queue import Sink

    class CancelledOnCheck(Future):  # the caller cancels just before the writer's answer lands
        def set_result(self, result: object) -> None:
            self.cancel()
            super().set_result(result)

        def set_exception(self, exception: BaseException | None) -> None:
            self.cancel()
            super().set_exception(exception)

    for answer in ("ok", "fail"):
        sink = Sink(1, single=True)
        sink.future = CancelledOnCheck()
        if answer == "ok":
            sink.ok(0, None)  # type: ignore[arg-type]
        else:
            sink.fail(RuntimeError("refused"))
        assert sink.future.cancelled()


def test_publish_rows_refuses_a_layout_whose_a_and_b_dtypes_differ(target: StoreTarget) -> None:
    from mint_store.format.layout import Layout, TensorSpec

    good = random_adapter(1).layout
    mixed = Layout(good.base, tuple(TensorSpec(t.name, t.shape, "bfloat16" if t.name.endswith("lora_B") else t.dtype,
                                               t.offset) for t in good.tensors), good.row_nbytes)
    with target.open() as store:
        with pytest.raises(InvalidAdapter, match="different dtypes"):
            store.publish_rows([("acme", "m")], mixed, np.zeros((1, mixed.row_nbytes), np.uint8))
        with pytest.raises(AdapterNotFound):
            store.resolve("acme/m")
