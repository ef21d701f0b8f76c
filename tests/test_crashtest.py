"""A small run of tools/crashtest.py's kill loop: compaction and reindex killed at random moments."""

from __future__ import annotations

import pytest

from mint_store.store import Store
from mint_store.testing.crashtest import run


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["compact", "reindex"])
def test_kill_loop_finds_no_problem(tmp_path, mode: str) -> None:
    report = run(mode, tmp_path / "store", kills=3, seed=7, max_seconds=120, max_wait_s=0.8)
    assert report.kills == 3
    assert report.problems == []
    with Store.open(str(tmp_path / "store")) as store:
        versions = list(store.iter_versions())
    if mode == "reindex":  # the parent published 40 versions; the rebuilt index holds exactly those
        assert report.acknowledged == 40 and len(versions) == 40
    else:  # every acknowledged publish is in the index (a few unacknowledged ones may be too)
        assert report.acknowledged > 0 and len(versions) >= report.acknowledged
