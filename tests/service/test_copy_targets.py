"""The callers' memfds the local copy server keeps mapped (mint_store.service.copy_targets):
only memory that cannot shrink under the mapping is mapped, each buffer once while it is sent
again, and what is kept stays within its bounds."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mint_store.service import copy_targets
from mint_store.service.copy_targets import MIN_MAPPED, CopyTargets, Mapped

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create is Linux's")

MB = 1 << 20


@pytest.fixture
def fds() -> Iterator[list[int]]:
    opened: list[int] = []
    yield opened
    for fd in opened:
        os.close(fd)


def _memfd(fds: list[int], n: int, seals: int = fcntl.F_SEAL_SHRINK) -> int:
    fd = os.memfd_create("test-buffer", os.MFD_ALLOW_SEALING)
    fds.append(fd)
    os.ftruncate(fd, n)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _kept(t: CopyTargets, fd: int, length: int) -> Mapped:
    """The mapping of ``fd`` after a first copy into it (``keep``), taken for the next."""
    assert t.take(fd, length) is None  # not mapped yet: the first copy goes through the file
    t.keep(fd, length)
    m = t.take(fd, length)
    assert m is not None
    return m


def test_only_memory_that_cannot_shrink_is_mapped(fds: list[int], tmp_path: Path) -> None:
    t = CopyTargets(64 * MB)
    f = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
    fds.append(f)
    os.ftruncate(f, 4 * MB)
    for fd, n in ((_memfd(fds, 4 * MB, seals=0), 4 * MB),  # could shrink: a store past its end kills
                  (_memfd(fds, 4 * MB, seals=fcntl.F_SEAL_GROW), 4 * MB),
                  (f, 4 * MB),  # a regular file: its file interface
                  (_memfd(fds, MIN_MAPPED), MIN_MAPPED - 1)):  # small: nothing to gain
        t.keep(fd, n)
        assert t.take(fd, n) is None
    assert t.mapped == 0 and t.kept_bytes == 0
    m = _kept(t, _memfd(fds, 4 * MB), 4 * MB)
    assert m.size == 4 * MB and t.mapped == 1
    m.mm[:4] = b"row!"  # writable, and the caller's memory
    assert os.pread(fds[-1], 4, 0) == b"row!"
    m.close()


def test_a_buffer_sent_again_is_the_mapping_kept_for_it(fds: list[int]) -> None:
    t = CopyTargets(64 * MB)
    fd = _memfd(fds, 4 * MB)
    first = _kept(t, fd, 3 * MB)
    t.give_back(first)
    other = os.dup(fd)  # another descriptor of the same memfd, as SCM_RIGHTS gives the service
    fds.append(other)
    again = t.take(other, 4 * MB)
    assert again is first and (t.mapped, t.reused) == (1, 2)
    assert t.kept_bytes == 0  # (taken out while copied into)
    t.give_back(again)
    assert t.kept_bytes == 4 * MB
    t.clear()
    assert t.kept_bytes == 0 and first.mm.closed


def test_a_memfd_that_grew_is_mapped_again_whole(fds: list[int]) -> None:
    t = CopyTargets(64 * MB)
    fd = _memfd(fds, 2 * MB)
    m = _kept(t, fd, 2 * MB)
    t.give_back(m)
    os.ftruncate(fd, 6 * MB)  # (sealed against shrinking only: it may grow)
    assert t.take(fd, 6 * MB) is None and m.mm.closed
    bigger = _kept(t, fd, 6 * MB)
    assert bigger.size == 6 * MB
    t.give_back(bigger)


def test_what_is_kept_stays_within_bytes_least_recently_used_out_first(fds: list[int]) -> None:
    t = CopyTargets(10 * MB)
    ma, mb, mc = (_kept(t, _memfd(fds, 4 * MB), 4 * MB) for _ in range(3))
    for m in (ma, mb, mc):
        t.give_back(m)
    assert t.kept_bytes == 8 * MB and ma.mm.closed and not mb.mm.closed
    none_kept = CopyTargets(0)
    fd = _memfd(fds, 4 * MB)
    none_kept.keep(fd, 4 * MB)
    assert none_kept.take(fd, 4 * MB) is None and none_kept.mapped == 0


def test_a_mapping_unused_for_idle_s_is_dropped(fds: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(copy_targets.time, "monotonic", lambda: now[0])
    t = CopyTargets(64 * MB, idle_s=30.0)
    a, b = _memfd(fds, 4 * MB), _memfd(fds, 4 * MB)
    ma = _kept(t, a, 4 * MB)
    t.give_back(ma)
    now[0] += 31.0
    assert t.take(b, 4 * MB) is None  # (any take or give_back sweeps)
    assert ma.mm.closed and t.kept_bytes == 0
    t.keep(b, 4 * MB)
    assert t.kept_bytes == 4 * MB


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="keep_bytes"):
        CopyTargets(-1)
    with pytest.raises(ValueError, match="idle_s"):
        CopyTargets(MB, idle_s=0)


def test_the_service_config_refuses_a_bad_local_map_bytes(tmp_path: Path) -> None:
    from mint_store.service import ServiceConfig

    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="local_map_bytes"):
            ServiceConfig(store=str(tmp_path), local_map_bytes=bad)  # type: ignore[arg-type]
    assert ServiceConfig(store=str(tmp_path), local_map_bytes=0).local_map_bytes == 0
