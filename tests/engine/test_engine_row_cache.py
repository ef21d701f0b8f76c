"""``LoRAEngine(row_cache_dir=...)``: the engine's disk row cache, shared by the engines of a node.

Two engines on S3 (moto on 127.0.0.1), each with its own client and index directory as two
engine processes of one node would have, share one cache directory: the second engine's load
comes from the disk (hits in the cache's own stats) even with the rows gone from the bucket,
and its outputs are the first engine's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_client import LoRAEngine, MintClient
from mint_store.storage import open_storage
from tests.support.engine import TENANT, publish_dirs
from tests.support.hf_models import ATTN, build_model, make_peft_dir, sample_ids
from tests.support.targets import StoreTarget, make_bucket, s3_options

IDS = sample_ids(batch=2, seq=5, seed=3)


def _engine(target: StoreTarget, index: Path, cache: Path) -> LoRAEngine:
    client = MintClient(target.url, index_dir=str(index), storage_options=target.storage_options, readonly=True)
    return LoRAEngine(build_model("llama"), client, row_cache_dir=cache, row_cache_bytes=1 << 30)


def _run(engine: LoRAEngine) -> torch.Tensor:
    with torch.no_grad():
        return engine.forward(IDS, adapters=[f"{TENANT}/a", f"{TENANT}/b"]).logits


def test_a_second_engine_loads_from_the_first_ones_disk_cache(s3_endpoint: str, tmp_path: Path) -> None:
    target = StoreTarget("s3", f"s3://{make_bucket(s3_endpoint)}/mint", str(tmp_path / "writer-index"),
                         s3_options(s3_endpoint))
    publish_dirs(target, {"a": make_peft_dir(tmp_path / "a", "llama", r=4, lora_alpha=8, target_modules=ATTN),
                          "b": make_peft_dir(tmp_path / "b", "llama", r=2, lora_alpha=4, target_modules=ATTN)})
    cache = tmp_path / "rows"
    first = _engine(target, tmp_path / "i1", cache)
    try:
        expected = _run(first)
        assert first.streamer.row_cache is not None
        stats = first.streamer.row_cache.stats()
        assert (stats.hits, stats.misses, stats.writes) == (0, 2, 2)
    finally:
        first.close()
    # the rows' chunks leave the bucket: the second engine can only get them from the disk cache
    storage = open_storage(target.url, storage_options=target.storage_options)
    chunks = [k for k in storage.list("packs/") if "/c/" in k]
    assert chunks
    for key in chunks:
        storage.delete(key)
    second = _engine(target, tmp_path / "i2", cache)
    try:
        assert torch.equal(_run(second), expected)
        assert second.streamer.row_cache is not None
        stats = second.streamer.row_cache.stats()
        assert (stats.hits, stats.misses, stats.corrupt) == (2, 0, 0)
    finally:
        second.close()


def test_bad_row_cache_bytes_is_refused_before_anything_opens(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="row_cache_bytes"):
        LoRAEngine(build_model("llama"), str(tmp_path / "nowhere"), row_cache_dir=tmp_path / "rows",
                   row_cache_bytes=-1)
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "rows").exists()


def test_a_compaction_or_quarantine_in_the_feed_re_resolves_the_refs_cached_on_those_rows() -> None:
    """The feed's entry for a compaction is kind "compact" (as the writer logs it, through the
    feed's own summary): refs cached on a moved or quarantined row are resolved again, others kept."""
    from engine_client.engine.refs import RefTable
    from mint_store import Location
    from mint_store.index.commit_log import summarize

    table = RefTable()
    table.following = True
    moved, kept = "a" * 32, "b" * 32

    def loc(cid: str) -> Location:
        return Location(content_id=cid, layout_id="l" * 32, shard_key="packs/x/rows/c/0/0", offset=0, length=8, row=0)

    for ref, cid in (("t/a:prod", moved), ("t/a@1", moved), (f"sha:{moved}", moved), ("t/b", kept)):
        table.put(ref, loc(cid))
    compact = summarize({"seq": 9, "kind": "compact", "time": 0.0, "layout_id": "l" * 32,
                         "moves": [[moved, "packs/x/rows/c/1/0", 0]], "retired": []})
    assert sorted(table.affected(compact)) == sorted(["t/a:prod", "t/a@1", f"sha:{moved}"])
    quarantine = summarize({"seq": 10, "kind": "quarantine", "time": 0.0, "content_ids": [kept]})
    assert table.affected(quarantine) == ["t/b"]
