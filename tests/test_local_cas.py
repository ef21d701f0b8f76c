"""The local directory's compare-and-swap (the writer lease's): no lock held across it.

A CASer stopped (SIGSTOP: a paused VM, a debugger) anywhere in its CAS must not hold up
another process's CAS, and must fail (ObjectChanged) when it resumes; versions are
collected; a legacy plain lease file is migrated; concurrent CAS loses no update.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mint_store.errors import ObjectChanged, ObjectExists
from mint_store.storage.local import LocalStorage

KEY = "writer.lease"

# a child that reads the token, then stops itself before its CAS ("before") or inside it,
# while its data is being written ("inside": the old code held the key's flock there)
CHILD = r"""
import os, signal, sys
from mint_store.errors import ObjectChanged
from mint_store.storage.local import LocalStorage

class StopWhenWritten(list):
    def __iter__(self):
        os.kill(os.getpid(), signal.SIGSTOP)
        return super().__iter__()

root, where = sys.argv[1], sys.argv[2]
s = LocalStorage(root)
_, token = s.get_with_token("writer.lease")
if where == "before":
    os.kill(os.getpid(), signal.SIGSTOP)
    data = [b"child"]
else:
    data = StopWhenWritten([b"child"])
try:
    s.replace_if("writer.lease", data, token)
except ObjectChanged:
    sys.exit(3)
sys.exit(0)
"""

COUNTER = r"""
import sys
from mint_store.errors import ObjectChanged
from mint_store.storage.local import LocalStorage

s = LocalStorage(sys.argv[1])
wins = 0
while wins < int(sys.argv[2]):
    data, token = s.get_with_token("counter")
    try:
        s.replace_if("counter", str(int(data) + 1).encode(), token)
        wins += 1
    except ObjectChanged:
        pass
"""


def _versioned(s: LocalStorage, data: bytes) -> None:
    """Create ``KEY`` and CAS it once (a plain file becomes versions)."""
    s.create(KEY, b"first")
    s.replace_if(KEY, data, s.get_with_token(KEY)[1])


def _wait_stopped(proc: subprocess.Popen[bytes]) -> None:
    _, status = os.waitpid(proc.pid, os.WUNTRACED)  # returns once the child has stopped itself
    assert os.WIFSTOPPED(status), f"the child exited instead of stopping (status {status})"


@pytest.mark.parametrize("where", ["before", "inside"])
@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy-file"])
def test_stopped_casser_holds_nobody_up_and_fails_when_resumed(tmp_path: Path, where: str, legacy: bool) -> None:
    s = LocalStorage(tmp_path)
    if legacy:
        s.create(KEY, b"first")  # a plain file, as stores made before versioned CAS have
    else:
        _versioned(s, b"second")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), where])
    try:
        _wait_stopped(child)
        outcome: list[object] = []

        def cas() -> None:
            try:
                s.replace_if(KEY, b"standby", s.get_with_token(KEY)[1])
                outcome.append("won")
            except BaseException as e:  # reported by the assertion below
                outcome.append(e)

        t = threading.Thread(target=cas, daemon=True)
        t.start()
        t.join(timeout=60)  # a hang guard only: the CAS needs no time from the stopped child
        blocked = t.is_alive()
        if blocked:
            child.kill()  # frees whatever it holds, so the thread ends
            t.join()
        assert not blocked, f"a CAS blocked on a process stopped {where} its own CAS"
        assert outcome == ["won"]
        os.kill(child.pid, signal.SIGCONT)
        assert child.wait() == 3, "the resumed stale CAS must fail with ObjectChanged"
        assert s.get(KEY) == b"standby"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_versions_are_collected_and_a_stale_cas_after_collection_fails(tmp_path: Path) -> None:
    from mint_store.storage import local_cas

    s = LocalStorage(tmp_path)
    other = LocalStorage(tmp_path)
    _versioned(s, b"0")
    _, stale = s.get_with_token(KEY)  # then "paused" while the other does 40 CASes
    n = int(stale[1:])
    for i in range(1, 41):
        other.replace_if(KEY, str(i).encode(), other.get_with_token(KEY)[1])
    vdir = tmp_path / (KEY + local_cas.SUFFIX)
    assert len(os.listdir(vdir)) <= local_cas.KEEP
    assert not (vdir / f"{n + 1:0{local_cas.WIDTH}d}").exists(), "version n+1 should have been collected"
    with pytest.raises(ObjectChanged):
        s.replace_if(KEY, b"stale", stale)  # its link of n+1 succeeds: the check must catch it
    assert s.get(KEY) == b"40"
    assert s.get_with_token(KEY) == (b"40", f"v{n + 40}")
    assert not (vdir / f"{n + 1:0{local_cas.WIDTH}d}").exists(), "the stale version was left behind"
    assert s.list("") == [KEY]
    assert s.exists(KEY) and s.size(KEY) == 2


def test_a_legacy_plain_lease_file_is_migrated(tmp_path: Path) -> None:
    (tmp_path / KEY).write_bytes(b"legacy")  # what an older version left
    s = LocalStorage(tmp_path)
    data, token = s.get_with_token(KEY)
    assert data == b"legacy" and len(token) == 64  # the sha256 token, as before
    s.replace_if(KEY, b"migrated", token)
    assert s.get_with_token(KEY) == (b"migrated", "v1")
    assert s.get(KEY) == b"migrated" and s.size(KEY) == len(b"migrated")
    with pytest.raises(ObjectChanged):
        s.replace_if(KEY, b"again", token)  # the legacy bytes are still there; the value is not
    with pytest.raises(ObjectExists):
        s.create(KEY, b"new")
    s.replace_if(KEY, b"next", "v1")
    assert s.get(KEY) == b"next"
    assert s.list("") == [KEY]  # no versions directory, no lock file
    s.delete(KEY)
    assert not s.exists(KEY) and s.list("") == []


def test_concurrent_cas_loses_no_update(tmp_path: Path) -> None:
    s = LocalStorage(tmp_path)
    s.create("counter", b"0")
    procs, each = 4, 25
    children = [subprocess.Popen([sys.executable, "-c", COUNTER, str(tmp_path), str(each)]) for _ in range(procs)]
    assert [c.wait() for c in children] == [0] * procs
    assert s.get("counter") == str(procs * each).encode()
    assert s.get_with_token("counter")[1] == f"v{procs * each}"  # exactly one winner per version


def test_a_standby_takes_the_lease_from_a_holder_stopped_inside_its_cas(tmp_path: Path) -> None:
    import json

    from mint_store.write.lease import WriterLease

    s = LocalStorage(tmp_path)
    s.create(KEY, json.dumps({"format": 1, "epoch": 4, "expires": 0.0, "released": False,
                              "holder": {"id": "old", "host": "elsewhere", "pid": 1}}).encode())
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), "inside"])
    lease = WriterLease(s, ttl_s=30.0, renew_s=10.0)
    try:
        _wait_stopped(child)  # the old holder, mid-renew of an expired lease
        t = threading.Thread(target=lease.acquire, daemon=True)
        t.start()
        t.join(timeout=60)  # a hang guard only
        blocked = t.is_alive()
        if blocked:
            child.kill()
            t.join()
        assert not blocked, "the take-over blocked on a holder stopped inside its CAS"
        assert lease.epoch == 5 and json.loads(s.get(KEY))["holder"]["id"] != "old"
        os.kill(child.pid, signal.SIGCONT)
        assert child.wait() == 3  # the stopped holder's renewal fails: it is fenced
        lease.check()  # the standby still holds it
    finally:
        lease.release()
        if child.poll() is None:
            child.kill()
            child.wait()
