"""A TP rank's first read of a row is its slice only, verified, on every client: a local store,
S3 (moto on loopback, concurrent ranged GETs) and the service on a local directory and on S3
(one multi-range ``Range`` request answered ``multipart/byteranges``). The blocks it reads are
checked against the block digests the writer recorded at publish -- by the client, and by the
service before it sends them; a flipped byte inside them fails the read, one outside them is
never read (by the client nor by the service)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from engine_client import MintClient
from engine_client.engine.targets import model_targets
from engine_client.tp.reads import ClientIO, SliceReader, StoreIO
from engine_client.tp.sharding import SlicedPool
from mint_store.errors import IntegrityError
from mint_store.format import blocks
from mint_store.format.layout import build_layout, encode_rows
from mint_store.read import vread
from tests.support.factories import corrupt_byte
from tests.support.hf_models import build_model
from tests.support.targets import StoreTarget, make_bucket, s3_options

from .test_tp_slices import TENSORS, _tp

WORLD = 2


def _layout() -> Any:
    shapes = [(f"{n}.{k}", s, "float32") for n, a, b in TENSORS for k, s in (("lora_A", a), ("lora_B", b))]
    return build_layout("base", [*shapes, ("scaling", (len(TENSORS),), "float32")])


@pytest.fixture(scope="module")
def targets() -> Any:
    return model_targets(build_model("qwen3_moe"))


@pytest.fixture
def fine_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block digests for these small rows too, 8 blocks per sliced tensor (the defaults skip rows
    under 256 KiB and blocks under 4 KiB)."""
    monkeypatch.setattr(blocks, "MIN_ROW_BYTES", 0)
    monkeypatch.setattr(blocks, "MIN_BLOCK_BYTES", 1)
    monkeypatch.setattr(vread, "GAP", 0)  # S3: a GET per range (rows this small would be one GET)


@pytest.fixture(params=["local", "s3", "http", "http-s3"])
async def setup(request: pytest.FixtureRequest, tmp_path: Path,
                fine_grid: None) -> AsyncIterator[tuple[str, Any, Any, Any]]:
    """(kind, storage, client, rows): two rows published through a store; a client of the kind."""
    kind = request.param
    if kind in ("s3", "http-s3"):
        endpoint = request.getfixturevalue("s3_endpoint")
        target = StoreTarget("s3", f"s3://{make_bucket(endpoint)}/mint", str(tmp_path / "index"), s3_options(endpoint))
    else:
        target = StoreTarget("local", str(tmp_path / "store"), str(tmp_path / "index"), None)
    layout = _layout()
    g = torch.Generator().manual_seed(7)
    tensors = {t.name: torch.randn(2, *t.shape, generator=g) for t in layout.tensors}
    rows = encode_rows(layout, tensors, 2)
    store = target.open()
    store.publish_rows([("t", "a"), ("t", "b")], layout, rows)
    server = None
    storage = store.storage
    if kind.startswith("http"):  # the service is the store's writer: this process lets go of it
        from mint_store.service import ServiceConfig, start_server
        from mint_store.storage import open_storage

        store.close()
        store = None
        storage = open_storage(target.url, storage_options=target.storage_options)
        (tmp_path / "uploads").mkdir()
        server = await start_server(ServiceConfig(store=target.url, index_dir=str(tmp_path / "index-srv"),
                                                  storage_options=target.storage_options,
                                                  host="127.0.0.1", port=0, upload_dir=str(tmp_path / "uploads"),
                                                  workers=2))
        client = MintClient(server.url)
    else:
        client = MintClient(target.url, index_dir=target.index_dir,
                            storage_options=target.storage_options, readonly=True)
    try:
        yield kind, storage, client, rows
    finally:
        await client.close()
        if server is not None:
            await server.stop()
        if store is not None:
            store.close()


async def _read(client: Any, reader: SliceReader, loc: Any, pool: SlicedPool) -> tuple[torch.Tensor, int]:
    loop = asyncio.get_running_loop()
    io = ClientIO(lambda aw: asyncio.run_coroutine_threadsafe(aw, loop).result(), client)
    got = await asyncio.to_thread(reader.read_slice, io, loc, pool)
    assert got is not None, "a row published with block digests is read by slices"
    return got


@pytest.mark.parametrize("rank", range(WORLD))
async def test_first_read_of_a_row_is_this_ranks_slice_only_and_verified(setup: Any, targets: Any,
                                                                         rank: int) -> None:
    kind, _, client, rows = setup
    loc = (await client.resolve_many(["t/a"]))[0]
    pool = SlicedPool(_layout(), targets, _tp(rank, WORLD), 1, "cpu")
    assert pool.source.layout_id == loc.layout_id
    want = pool.slice_row(torch.from_numpy(rows[0].copy()))  # the slice of the whole, published row
    reader = SliceReader()

    sliced, nbytes = await _read(client, reader, loc, pool)
    assert torch.equal(sliced, want)
    # the first read is the slice: half of each sharded tensor plus the replicated ones, exactly
    slice_bytes = sum(r.nbytes for r in pool.runs)
    cut = sum(c.src.nbytes for c in pool.cuts if c.dim is not None)
    whole = sum(c.src.nbytes for c in pool.cuts if c.dim is None)
    assert nbytes == slice_bytes == cut // WORLD + whole < loc.length, kind
    assert reader.known(loc.content_id)

    again, n2 = await _read(client, reader, loc, pool)  # later reads: the slice digest
    assert torch.equal(again, want) and n2 == slice_bytes


async def test_a_flipped_byte_in_this_ranks_blocks_fails_the_first_read_one_outside_is_not_read(
        setup: Any, targets: Any) -> None:
    _, storage, client, rows = setup
    loc = (await client.resolve_many(["t/b"]))[0]
    pools = [SlicedPool(_layout(), targets, _tp(r, WORLD), 1, "cpu") for r in range(WORLD)]
    # a byte of rank 1's rows of the first column-parallel B (q_proj's B [32, 3]: rank 1 holds rows 16..31)
    c = next(c for c in pools[1].cuts if c.dim is not None and c.dim == len(c.src.shape) - 2)
    at = c.src.offset + c.pieces[0][0] * c.src.shape[-1] * 4
    corrupt_byte(storage, loc.shard_key, loc.offset + at)
    with pytest.raises(IntegrityError, match="does not match the digest its commit recorded"):
        await _read(client, SliceReader(), loc, pools[1])
    sliced, _ = await _read(client, SliceReader(), loc, pools[0])  # rank 0 never reads that byte
    assert torch.equal(sliced, pools[0].slice_row(torch.from_numpy(rows[1].copy())))


async def test_a_damaged_block_table_is_refused(setup: Any, targets: Any) -> None:
    _, storage, client, _ = setup

    loc = (await client.resolve_many(["t/a"]))[0]
    corrupt_byte(storage, blocks.table_key(loc.shard_key), 60)  # inside the index of rows
    pool = SlicedPool(_layout(), targets, _tp(0, WORLD), 1, "cpu")
    with pytest.raises(IntegrityError, match="block table"):
        await _read(client, SliceReader(), loc, pool)


def test_a_row_without_block_digests_is_read_whole(tmp_path: Path, targets: Any, fine_grid: None) -> None:
    # rows a compaction moved (or an older build published) have no block table: read whole
    target = StoreTarget("local", str(tmp_path / "store"), str(tmp_path / "index"), None)
    layout = _layout()
    rows = encode_rows(layout, {t.name: torch.randn(1, *t.shape) for t in layout.tensors}, 1)
    with target.open() as store:
        store.publish_rows([("t", "a")], layout, rows)
        loc = store.resolve("t/a")
        with store._idx().write() as t:  # the shard record of a row published before block digests
            rec = t.get("shards", loc.shard_key.encode())
            rec.pop("blocks")
            t.put("shards", loc.shard_key.encode(), rec)
        pool = SlicedPool(layout, targets, _tp(0, WORLD), 1, "cpu")
        assert SliceReader().read_slice(StoreIO(store), loc, pool) is None


def test_small_rows_get_no_block_digests(tmp_path: Path) -> None:
    # under MIN_ROW_BYTES a slice saves less than a round trip: no table, no publish cost, no overhead
    target = StoreTarget("local", str(tmp_path / "store"), str(tmp_path / "index"), None)
    layout = _layout()
    assert layout.row_nbytes < blocks.MIN_ROW_BYTES
    rows = encode_rows(layout, {t.name: torch.randn(1, *t.shape) for t in layout.tensors}, 1)
    with target.open() as store:
        store.publish_rows([("t", "a")], layout, rows)
        assert StoreIO(store).row_blocks(store.resolve("t/a")) is None
        assert not store.storage.list("blocks/")


def test_a_large_tensor_is_cut_into_blocks_of_at_least_min_block_bytes() -> None:
    # [16, 4096] float32 A: 8 blocks of 32 KiB; [4, 256] float32 A (4 KiB): one block; [8, 512]: two
    lay = build_layout("base", [("m.lora_A", (16, 4096), "float32"), ("m.lora_B", (64, 16), "float32"),
                                ("n.lora_A", (4, 256), "float32"), ("n.lora_B", (8, 4), "float32"),
                                ("o.lora_A", (8, 512), "float32"), ("o.lora_B", (8, 8), "float32"),
                                ("scaling", (3,), "float32")])
    counts: dict[str, int] = {}
    for b in blocks.grid_of(lay, blocks.Grid()):
        counts[b.tensor] = counts.get(b.tensor, 0) + 1
    assert counts == {"m.lora_A": 8, "m.lora_B": 1, "n.lora_A": 1, "n.lora_B": 1, "o.lora_A": 4, "o.lora_B": 1,
                      "scaling": 1}


@pytest.mark.parametrize("setup", ["http"], indirect=True)
async def test_the_service_answers_several_ranges_with_multipart_byteranges(setup: Any) -> None:
    _, _, client, rows = setup
    loc = (await client.resolve_many(["t/a"]))[0]
    url = f"{client.url}/v1/blobs/{loc.content_id}"
    async with aiohttp.ClientSession() as s, s.get(url, headers={"Range": "bytes=0-9,64-127,200-200"}) as r:
        assert r.status == 206 and r.headers["Content-Type"].startswith("multipart/byteranges")
        reader = aiohttp.MultipartReader(r.headers, r.content)
        parts = []
        while (part := await reader.next()) is not None:
            assert isinstance(part, aiohttp.BodyPartReader)
            parts.append((part.headers["Content-Range"], bytes(await part.read(decode=False))))
    row = rows[0].tobytes()
    assert parts == [(f"bytes 0-9/{loc.length}", row[0:10]), (f"bytes 64-127/{loc.length}", row[64:128]),
                     (f"bytes 200-200/{loc.length}", row[200:201])]
    n = loc.length
    async with aiohttp.ClientSession() as s:
        async with s.get(url, headers={"Range": "bytes=0-99,50-60"}) as r:  # overlapping: the whole row (RFC 9110)
            assert r.status == 200 and await r.read() == row
        async with s.get(url, headers={"Range": f"bytes={n}-{n + 5},{n + 9}-{n + 9}"}) as r:  # none inside
            assert r.status == 416


@pytest.mark.parametrize("setup", ["http"], indirect=True)
async def test_many_ranges_through_the_service_go_in_several_requests_within_its_header_limit(setup: Any) -> None:
    from engine_client.client.http_ranges import range_groups

    _, _, client, rows = setup
    loc = (await client.resolve_many(["t/a"]))[0]
    ranges = [(o, 2) for o in range(0, loc.length - 2, 5)]  # a Range header of ~20 KB in one piece
    assert len(range_groups(ranges)) > 2
    out = bytearray(loc.length)
    assert await client.read_ranges(loc, ranges, out) == 2 * len(ranges)
    row = rows[0].tobytes()
    assert all(out[o : o + n] == row[o : o + n] for o, n in ranges)


async def test_a_service_without_the_blocks_route_means_read_whole() -> None:
    # a service older than block digests answers 404 (no such route): the engine reads rows whole
    from aiohttp import web

    from mint_store import Location

    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with MintClient(f"http://127.0.0.1:{port}") as client:
            loc = Location("0" * 32, "1" * 32, "packs/x/rows/c/0/0", 0, 64, 0)
            assert await client.row_blocks(loc) is None
    finally:
        await runner.cleanup()


def test_s3_ranges_closer_than_the_gap_share_one_get(s3_endpoint: str) -> None:
    from mint_store.storage import open_storage

    storage = open_storage(f"s3://{make_bucket(s3_endpoint)}/x", storage_options=s3_options(s3_endpoint))
    data = bytes(range(256)) * 1024  # 256 KiB
    storage.put("obj", data)
    ranges = [(0, 10), (100, 10), (200_000, 16), (200_020, 4)]
    assert [(a, b) for a, b, _ in vread.spans(ranges, 1000)] == [(0, 110), (200_000, 200_024)]
    bufs = [memoryview(bytearray(n)) for _, n in ranges]
    fetched = vread.read_ranges_into(storage, "obj", ranges, bufs)
    assert fetched == 110 + 24  # two GETs, the gaps between close ranges fetched with them
    assert [bytes(b) for b in bufs] == [data[o : o + n] for o, n in ranges]


def _tensor_range(layout: Any, i: int) -> tuple[int, int]:
    t = layout.tensors[i]
    return t.offset, t.offset + t.nbytes


@pytest.mark.parametrize("setup", ["http", "http-s3"], indirect=True)
async def test_the_service_sends_one_range_of_a_row_checked_by_its_blocks(setup: Any) -> None:
    _, storage, client, rows = setup
    loc = (await client.resolve_many(["t/a"]))[0]
    layout = _layout()
    first, last = _tensor_range(layout, 0), _tensor_range(layout, len(TENSORS) * 2 - 1)
    corrupt_byte(storage, loc.shard_key, loc.offset + last[0] + 5)  # inside the last lora_B, not the first lora_A
    url = f"{client.url}/v1/blobs/{loc.content_id}"
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers={"Range": f"bytes={first[0]}-{first[1] - 1}"}) as resp:
            assert resp.status == 206
            assert await resp.read() == rows[0][first[0] : first[1]].tobytes()
        async with http.get(url, headers={"Range": f"bytes={last[0]}-{last[1] - 1}"}) as resp:
            body = await resp.read()
            assert resp.status == 500 and b"does not match the digest its commit recorded" in body
            assert rows[0][last[0] : last[1]].tobytes()[:8] not in body
        async with http.get(url) as resp:  # the whole row is checked whole
            assert resp.status == 500


def test_a_checked_part_reads_only_the_blocks_that_hold_it(tmp_path: Path, fine_grid: None) -> None:
    from mint_store.service.rows.checks import PartCheck, store_blocks
    from mint_store.storage import LocalStorage

    class Counting(LocalStorage):
        read = 0

        def read_into(self, key: str, offset: int, buf: memoryview) -> None:
            Counting.read += len(buf)
            super().read_into(key, offset, buf)

    target = StoreTarget("local", str(tmp_path / "store"), str(tmp_path / "index"), None)
    layout = _layout()
    rows = encode_rows(layout, {t.name: torch.randn(1, *t.shape) for t in layout.tensors}, 1)
    with target.open() as store:
        store.publish_rows([("t", "a")], layout, rows)
        loc = store.resolve("t/a")
        parts = PartCheck(Counting(target.url), store_blocks(store))
        a, z = _tensor_range(layout, 0)
        mid = (a + z) // 2  # inside one block of the first lora_A's columns: that block only
        got = parts.read(loc, [(a, a + 4), (mid, mid + 4)])
        assert got == rows[0][a : a + 4].tobytes() + rows[0][mid : mid + 4].tobytes()
        touched = blocks.blocks_touching(layout, store_blocks(store)(loc)[1].grid, [(a, 4), (mid, 4)])  # type: ignore[index]
        assert Counting.read == sum(b.nbytes for b in touched) < loc.length
        assert parts.read(loc, [(0, loc.length)]) is None  # the whole row: checked whole by the caller
        pad = layout.tensors[-1].offset + layout.tensors[-1].nbytes  # the row's padding lies in no block
        assert pad < loc.length
        assert parts.read(loc, [(a, a + 4), (pad, pad + 1)]) is None  # so the caller checks the row whole
