"""Our shard encoder writes exactly the bytes zarr's sharding codec writes."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from mint_store.format.packs import PackGeometry, encode_shard


@pytest.mark.parametrize(
    ("row_nbytes", "rows_per_shard", "chunk_cols", "k"),
    [(320, 8, 320, 8), (320, 8, 320, 3), (64, 1, 64, 1), (1000 * 64, 1, 16_384, 1), (192, 4, 192, 4)],
)
def test_encoded_shard_is_byte_identical_to_zarr(tmp_path, row_nbytes, rows_per_shard, chunk_cols, k) -> None:
    g = PackGeometry(row_nbytes, rows_per_shard, chunk_cols)
    rng = np.random.default_rng(k)
    rows = rng.integers(0, 256, (k, row_nbytes), dtype=np.uint8)
    store = zarr.storage.LocalStore(str(tmp_path))
    arr = zarr.create_array(store, name="rows", shape=(k, row_nbytes), chunks=(1, chunk_cols),
                            shards=(rows_per_shard, g.shard_cols), dtype="uint8", compressors=None, filters=None,
                            fill_value=0, config={"write_empty_chunks": True})
    arr[:] = rows
    theirs = (tmp_path / "rows" / "c" / "0" / "0").read_bytes()
    parts, offsets = encode_shard(rows, g)
    ours = b"".join(memoryview(p).cast("B") for p in parts)
    assert ours == theirs
    for i, off in enumerate(offsets):
        assert ours[off : off + row_nbytes] == rows[i].tobytes()
    np.testing.assert_array_equal(arr[:], rows)
