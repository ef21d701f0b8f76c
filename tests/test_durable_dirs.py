"""New directories are durable in their parents before a commit is acknowledged.

Durability cannot be observed without cutting power, so these tests watch the store's own
``fsync_dir`` calls: each records which directories existed when the parent was synced.
A directory's entry is durable once its parent was fsynced after the directory appeared.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import mint_store.storage.local as storage_mod
from tests.support.factories import random_adapter
from tests.support.targets import StoreTarget


def _dirs(root: Path) -> set[Path]:
    return {Path(d) for d, _, _ in os.walk(root)} - {root}


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch, local_target: StoreTarget) -> list[tuple[Path, set[Path]]]:
    """(directory fsynced, directories of the store that existed then), in call order."""
    calls: list[tuple[Path, set[Path]]] = []
    real = storage_mod.fsync_dir
    root = Path(local_target.url).resolve()

    def spy(path: Path) -> None:
        real(path)
        calls.append((Path(path).resolve(), _dirs(root) if root.exists() else set()))

    monkeypatch.setattr(storage_mod, "fsync_dir", spy)
    return calls


def _not_durable(root: Path, calls: list[tuple[Path, set[Path]]]) -> list[str]:
    """Directories under ``root`` whose parent was never fsynced after they appeared."""
    return sorted(
        str(d.relative_to(root)) for d in _dirs(root)
        if not any(p == d.parent and d in seen for p, seen in calls)
    )


def test_first_commit_makes_every_new_directory_durable(local_target: StoreTarget, synced) -> None:
    with local_target.open() as store:
        store.publish("acme", "a", random_adapter(1))
        root = Path(local_target.url).resolve()
        # log/, packs/<layout>/rows/c/0/ and every level between were synced in their parents
        assert _not_durable(root, synced) == []
        assert (root / "log").is_dir() and any("/rows/c/" in str(d) for d in _dirs(root))


def test_each_new_shard_directory_is_durable(local_target: StoreTarget, synced) -> None:
    with local_target.open(shard_target_bytes=1) as store:  # one row per shard: a new directory each
        for i in range(3):
            store.publish("acme", f"a{i}", random_adapter(i))
            root = Path(local_target.url).resolve()
            assert _not_durable(root, synced) == [], f"after publish {i}"
