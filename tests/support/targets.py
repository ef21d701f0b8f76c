"""Where a test's store lives: a local directory or a bucket on moto's S3 server on loopback."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


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
