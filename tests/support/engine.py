"""Helpers of the engine tests: PEFT adapters published to a real local store, engines over it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mint_store import PublishResult
from mint_store.peft.directory import load_peft_dir
from tests.support.targets import StoreTarget

TENANT = "t"


def publish_dirs(target: StoreTarget, dirs: Mapping[str, Path], *, tag: str | None = None) -> dict[str, PublishResult]:
    """Import each PEFT dir with ``load_peft_dir`` and publish it as ``t/<name>`` (store closed after)."""
    with target.open() as store:
        return {name: store.publish(TENANT, name, load_peft_dir(path), tag=tag) for name, path in dirs.items()}


def open_engine(model: Any, target: StoreTarget, **options: Any) -> Any:
    from engine_client import LoRAEngine, MintClient

    return LoRAEngine(model, MintClient(target.url, index_dir=target.index_dir), **options)


def publish_random(target: StoreTarget, n: int) -> dict[str, Any]:
    """Publish ``t/a{i}`` (random rank-4 adapters of one layout); ref -> its row bytes."""
    from tests.support.factories import random_adapter

    rows = {}
    with target.open() as store:
        for i in range(n):
            adapter = random_adapter(i, rank=4)
            store.publish("t", f"a{i}", adapter)
            rows[f"t/a{i}"] = adapter.to_row()[1]
    return rows
