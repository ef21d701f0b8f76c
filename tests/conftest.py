"""Shared fixtures: the same store tests run on a local directory and on S3 (moto on loopback)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")


@dataclass(frozen=True)
class StoreTarget:
    """Where a test's store lives: URL, fsspec options and a local index directory."""

    kind: str
    url: str
    index_dir: str
    storage_options: dict[str, Any] | None

    def open(self, **options: Any) -> Any:
        from mint_store.store import Store

        return Store.open(self.url, index_dir=self.index_dir, storage_options=self.storage_options, **options)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


def make_bucket(endpoint: str) -> str:
    import boto3

    name = f"mint-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


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
