"""Fixtures of the engine tests: PEFT adapters published to a real local store, engines over it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conftest import StoreTarget
from mint_store.peft_format import load_peft_dir
from mint_store.records import PublishResult

TENANT = "t"


def publish_dirs(target: StoreTarget, dirs: Mapping[str, Path], *, tag: str | None = None) -> dict[str, PublishResult]:
    """Import each PEFT dir with ``load_peft_dir`` and publish it as ``t/<name>`` (store closed after)."""
    with target.open() as store:
        return {name: store.publish(TENANT, name, load_peft_dir(path), tag=tag) for name, path in dirs.items()}


def open_engine(model: Any, target: StoreTarget, **options: Any) -> Any:
    from engine_client import LoRAEngine, MintClient

    return LoRAEngine(model, MintClient(target.url, index_dir=target.index_dir), **options)
