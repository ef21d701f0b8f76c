"""Shared fixtures: the same store tests run on a local directory and on S3 (moto on loopback)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.targets import StoreTarget, make_bucket, s3_options

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(params=["local", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Any) -> StoreTarget:
    """A fresh, empty store location on each backend."""
    if request.param == "local":
        return StoreTarget("local", str(tmp_path / "store"), str(tmp_path / "index"), None)
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = make_bucket(endpoint)
    return StoreTarget("s3", f"s3://{bucket}/mint", str(tmp_path / "index"), s3_options(endpoint))


@pytest.fixture
def local_target(tmp_path: Any) -> StoreTarget:
    return StoreTarget("local", str(tmp_path / "store"), str(tmp_path / "index"), None)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a test marked ``slow`` first, each file's tests kept together and in order.

    The suite runs on pytest-xdist by files (addopts: ``-n 2 --dist loadfile``): started first,
    the long files run side by side and the short ones fill in around them, rather than one long
    file running alone at the end.
    """
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
