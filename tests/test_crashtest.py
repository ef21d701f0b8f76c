"""A small run of tools/crashtest.py's kill loop: compaction and reindex killed at random moments."""

from __future__ import annotations

import pytest

from mint_store.crashtest import run


@pytest.mark.parametrize("mode", ["compact", "reindex"])
def test_kill_loop_finds_no_problem(tmp_path, mode: str) -> None:
    report = run(mode, tmp_path / "store", kills=3, seed=7, max_seconds=120, max_wait_s=0.8)
    assert report.kills == 3
    assert report.acknowledged > 0
    assert report.problems == []
