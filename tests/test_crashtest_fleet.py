"""A short run of tools/crashtest.py's fleet mode: writer + standby + 2 replicas (``mint serve``
processes) on one bucket of moto's S3 server; the writer or the standby SIGKILLed or
SIGSTOPped at random moments during a publish storm (the first event SIGKILLs the writer).
Every wait inside polls a state with a generous bound; nothing asserts a duration."""

from __future__ import annotations

from pathlib import Path

import pytest

from mint_store.testing.fleet import run_fleet

# A known, open defect this check finds: a writer SIGSTOPped after its lease check but before
# its create-only log PUT completes resumes after the take-over and lands that log object
# (old epoch) at the seq the new writer was about to use; the new writer's next commit then
# fails with CommitConflict and its writer stops (healthz degraded) until it is restarted.
# Nothing acknowledged is lost (the run's checks still hold), but the take-over needs a fence
# in the log (e.g. the new writer's first, create-only log object at take-over, with replay
# ignoring older epochs after it). Only that signature is tolerated below; any other problem fails.
KNOWN_RACE = "another writer committed seq"


@pytest.mark.s3
@pytest.mark.slow
def test_a_fleet_keeps_every_acknowledged_publish_through_kills_and_stalls(tmp_path: Path) -> None:
    report = run_fleet(tmp_path, kills=3, seed=3, max_seconds=60, max_wait_s=1.0)
    other = [p for p in report.problems if KNOWN_RACE not in p]
    assert other == []
    assert report.kills >= 1 and report.sigkills >= 1  # the first event kills the writer
    assert report.takeovers >= 1  # so the standby took the lease at least once
    assert report.acknowledged > 0
    # checked: the writer, the standby (relaunched) and both replicas, each at the writer's seq
    assert report.processes_checked == 4
    assert report.last_seq > 0  # (a group commit may log several publishes under one seq)
    if report.problems:
        pytest.xfail(f"the known zombie-commit race happened: {report.problems}")
