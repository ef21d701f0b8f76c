"""Session fixtures: the tiny model, the PEFT adapters, and a MinT service that holds them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support import ADAPTERS, BASE, Mint, World, build_adapter, build_model, start_mint


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("world")
    model = build_model(root / BASE)
    return World(model, {label: build_adapter(root / f"peft-{label}", seed, lora) for label, seed, lora in ADAPTERS})


@pytest.fixture(scope="session")
def mint(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mint]:
    m = start_mint(world, tmp_path_factory.mktemp("mint"))
    try:
        yield m
    finally:
        m.server.stop()
