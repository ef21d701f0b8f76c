"""A short run of tools/crashtest.py's fleet mode: writer + standby + 2 replicas (``mint serve``
processes) on one bucket of moto's S3 server; the writer or the standby SIGKILLed or
SIGSTOPped at random moments during a publish storm (the first event SIGKILLs the writer).
Every wait inside polls a state with a generous bound; nothing asserts a duration."""

from __future__ import annotations

from pathlib import Path

import pytest

from mint_store.testing.fleet import run_fleet


@pytest.mark.s3
@pytest.mark.slow
def test_a_fleet_keeps_every_acknowledged_publish_through_kills_and_stalls(tmp_path: Path) -> None:
    report = run_fleet(tmp_path, kills=3, seed=3, max_seconds=60, max_wait_s=1.0)
    # a writer SIGSTOPped between its lease check and its log PUT may land that commit after the
    # take-over (create-only decides it is the commit at that seq); the new writer applies it and
    # goes on (Writer._caught_up_after_conflict), so even that leaves no problem here
    assert report.problems == []
    assert report.kills >= 1 and report.sigkills >= 1  # the first event kills the writer
    assert report.takeovers >= 1  # so the standby took the lease at least once
    assert report.acknowledged > 0
    # checked: the writer, the standby (relaunched) and both replicas, each at the writer's seq
    assert report.processes_checked == 4
    assert report.last_seq > 0  # (a group commit may log several publishes under one seq)
