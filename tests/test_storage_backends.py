"""Every storage backend against one contract (tests/support/storage_suite.py): a local
directory, fsspec's memory://, and S3 through s3fs on moto's server on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mint_store.storage import open_storage
from tests.support.storage_suite import StorageTests
from tests.support.targets import make_bucket, s3_options


class TestLocalStorage(StorageTests):
    @pytest.fixture
    def storage(self, tmp_path: Path) -> Iterator[Any]:
        s = open_storage(str(tmp_path / "s"))
        yield s
        s.close()


class TestMemoryStorage(StorageTests):
    @pytest.fixture
    def storage(self) -> Iterator[Any]:
        s = open_storage(f"memory://mint-{uuid.uuid4().hex[:8]}/p")
        yield s
        s.close()


class TestS3Storage(StorageTests):
    @pytest.fixture
    def storage(self, s3_endpoint: str) -> Iterator[Any]:
        s = open_storage(f"s3://{make_bucket(s3_endpoint)}/p", storage_options=s3_options(s3_endpoint))
        yield s
        s.close()

    def test_a_replace_whose_precondition_fails_against_its_own_bytes_is_done(self, storage: Any) -> None:
        """s3fs retries a PUT by itself: a retry of an If-Match PUT that landed (its answer lost)
        fails the precondition against the object it just wrote. The lease record names its
        holder and expiry, so finding exactly our bytes means the write was ours."""
        from mint_store.errors import ObjectChanged

        storage.put("writer.lease", b"v1")
        stale = storage.get_with_token("writer.lease")[1]
        storage.replace_if("writer.lease", b"v2", stale)
        storage.replace_if("writer.lease", b"v2", stale)  # as the internal retry sends it again
        with pytest.raises(ObjectChanged):
            storage.replace_if("writer.lease", b"v3", stale)
        assert storage.get("writer.lease") == b"v2"
