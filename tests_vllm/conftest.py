"""Session fixtures: the tiny model, the PEFT adapters, and a MinT service that holds them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import ADAPTERS, BASE, build_adapter, build_model, serve_store

from mint_store.service import ServerThread


@dataclass
class World:
    model: Path  # the base model directory (its name is the MinT base name)
    adapters: dict[str, Path]  # label -> original PEFT directory


@dataclass
class Mint:
    server: ServerThread
    store: Path  # the service's store directory
    content: dict[str, str]  # acme/<label> -> content id


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("world")
    model = build_model(root / BASE)
    return World(model, {label: build_adapter(root / f"peft-{label}", seed, lora) for label, seed, lora in ADAPTERS})


def start_mint(world: World, root: Path) -> Mint:
    """A loopback MinT service holding the adapters:

    acme/a, acme/b, acme/c (tag prod each); acme/moving @1 = a, @2 = b, prod -> @1;
    acme/elsewhere = a published for another base.
    """
    from engine_client import SyncMintClient
    from mint_store.peft_format import load_peft_dir

    server = serve_store(root / "store")
    content = {}
    with SyncMintClient(server.url) as c:
        for label, path in world.adapters.items():
            content[f"acme/{label}"] = c.publish("acme", label, load_peft_dir(path, base=BASE), tag="prod").content_id
        for label in ("a", "b"):
            c.publish("acme", "moving", load_peft_dir(world.adapters[label], base=BASE))
        c.tag("acme/moving@1", "prod")
        c.publish("acme", "elsewhere", load_peft_dir(world.adapters["a"], base="other-model"))
    return Mint(server, root / "store", content)


@pytest.fixture(scope="session")
def mint(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mint]:
    m = start_mint(world, tmp_path_factory.mktemp("mint"))
    try:
        yield m
    finally:
        m.server.stop()
