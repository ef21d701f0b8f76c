"""Fixtures of the engine tests (their helpers: tests/support/engine.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.support.targets import StoreTarget


@pytest.fixture
async def client(local_target: StoreTarget) -> AsyncIterator[Any]:
    from engine_client import MintClient

    async with MintClient(local_target.url, index_dir=local_target.index_dir) as c:
        yield c
