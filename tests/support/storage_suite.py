"""The contract every storage backend keeps, as one test class each backend subclasses
(the way zarr-python's ``zarr.testing.store.StoreTests`` is reused by each zarr store).

A backend's test class derives from :class:`StorageTests` and overrides the ``storage``
fixture with a fresh, empty storage of its kind; every ``test_*`` here then runs on it.
Nothing here depends on the backend: what differs between backends is tested beside them.
"""

from __future__ import annotations

from typing import Any

import pytest

from mint_store.errors import BlobNotFound, InvalidKey, ObjectChanged, ObjectExists

# keys that would name something outside a backend's root (or something else than they say)
ESCAPING_KEYS = ["../secret", "/secret", "p/../../secret", "a/../../secret", "..\\secret", "a\\..\\..\\secret",
                 "a\x00b", "a//b", "./a", "a/.", "", "a\nb"]


class StorageTests:
    """Backend-independent assertions on :class:`mint_store.storage.Storage`."""

    @pytest.fixture
    def storage(self) -> Any:
        raise NotImplementedError("a backend's test class overrides the storage fixture with a fresh, empty storage")

    @pytest.fixture
    def outside(self) -> Any:
        """A storage over the parent of ``storage``'s root (the directory above, the bucket root)."""
        raise NotImplementedError("a backend's test class overrides the outside fixture")

    def test_keys_that_escape_the_root_are_refused_and_change_nothing(self, storage: Any, outside: Any) -> None:
        """Every method refuses a key that could leave the root (InvalidKey), before any I/O: a
        planted ``../`` or absolute key reads, overwrites or deletes nothing outside the store."""
        outside.put("secret", b"outside the store")
        storage.put("inside", b"x")
        for key in ESCAPING_KEYS:
            for call in (lambda k: storage.get(k), lambda k: storage.put(k, b"y"),
                         lambda k: storage.put_if_absent(k, b"y"), lambda k: storage.create(k, b"y"),
                         lambda k: storage.exists(k), lambda k: storage.size(k), lambda k: storage.delete(k),
                         lambda k: storage.read_into(k, 0, memoryview(bytearray(4))),
                         lambda k: storage.get_with_token(k)):
                with pytest.raises(InvalidKey):
                    call(key)
            if key:  # (the empty prefix lists everything, by design)
                with pytest.raises(InvalidKey):
                    storage.list(key)
        assert outside.get("secret") == b"outside the store"
        assert storage.list("") == ["inside"]

    def test_put_if_absent_never_overwrites(self, storage: Any) -> None:
        storage.put_if_absent("log/a.json", b"first")
        with pytest.raises(ObjectExists):
            storage.put_if_absent("log/a.json", [b"sec", b"ond"])
        assert storage.get("log/a.json") == b"first"
        # compare-and-swap: only the holder of the current token replaces
        data, token = storage.get_with_token("log/a.json")
        assert data == b"first"
        storage.replace_if("log/a.json", b"second", token)
        with pytest.raises(ObjectChanged):
            storage.replace_if("log/a.json", b"third", token)
        assert storage.get("log/a.json") == b"second"
        assert not any(k.endswith(".tmp") for k in storage.list(""))

    def test_put_writes_parts_back_to_back_and_replaces(self, storage: Any) -> None:
        storage.put("packs/x/zarr.json", [b"ab", memoryview(b"cd"), bytearray(b"e")])
        assert storage.get("packs/x/zarr.json") == b"abcde"
        assert storage.exists("packs/x/zarr.json") and storage.size("packs/x/zarr.json") == 5
        storage.put("packs/x/zarr.json", b"new")
        assert storage.get("packs/x/zarr.json") == b"new" and storage.size("packs/x/zarr.json") == 3

    def test_a_missing_object_is_blob_not_found(self, storage: Any) -> None:
        assert not storage.exists("log/none.json")
        for read in (lambda: storage.get("log/none.json"), lambda: storage.size("log/none.json"),
                     lambda: storage.read_range("log/none.json", 0, 1)):
            with pytest.raises(BlobNotFound):
                read()
        storage.delete("log/none.json")  # deleting what is not there is no error
        assert storage.list("log/") == []

    def test_ranges_read_the_bytes_at_their_offset(self, storage: Any) -> None:
        storage.put("packs/x/rows/c/0/0", bytes(range(256)))
        assert storage.read_range("packs/x/rows/c/0/0", 10, 5) == bytes(range(10, 15))
        buf = bytearray(3)
        storage.read_into("packs/x/rows/c/0/0", 253, memoryview(buf))
        assert bytes(buf) == bytes([253, 254, 255])
        with pytest.raises(BlobNotFound, match="shorter"):
            storage.read_range("packs/x/rows/c/0/0", 250, 10)
        # the same answers everywhere (S3 answered a range past the end with an untyped OSError, a
        # zero-length read with BlobNotFound, a negative offset with bytes from the end)
        with pytest.raises(BlobNotFound, match="shorter"):
            storage.read_range("packs/x/rows/c/0/0", 300, 5)  # starts past the end
        assert storage.read_range("packs/x/rows/c/0/0", 3, 0) == b""
        with pytest.raises(BlobNotFound):
            storage.read_range("packs/x/rows/c/0/none", 0, 0)
        with pytest.raises(ValueError):
            storage.read_range("packs/x/rows/c/0/0", -4, 2)

    def test_list_is_recursive_sorted_and_under_the_prefix(self, storage: Any) -> None:
        for key in ("packs/b/rows/c/0/1", "packs/a/zarr.json", "log/1.json", "packs/b/rows/c/0/0"):
            storage.put(key, b"x")
        assert storage.list("packs/") == ["packs/a/zarr.json", "packs/b/rows/c/0/0", "packs/b/rows/c/0/1"]
        assert storage.list("packs/b/rows") == ["packs/b/rows/c/0/0", "packs/b/rows/c/0/1"]
        assert storage.list("") == ["log/1.json", *storage.list("packs/")]
        assert storage.list("nothing/") == []
        storage.delete("packs/a/zarr.json")
        assert not storage.exists("packs/a/zarr.json") and "packs/a/zarr.json" not in storage.list("packs/")

    def test_create_refuses_other_bytes_and_changes_nothing(self, storage: Any) -> None:
        storage.create("log/x.json", b"ours")
        assert storage.get("log/x.json") == b"ours"
        storage.put("log/y.json", b"theirs")
        with pytest.raises(ObjectExists):
            storage.create("log/y.json", b"ours")
        assert storage.get("log/y.json") == b"theirs"
        # its own bytes already there, on the first try: the S3 client's own retry of a PUT that
        # landed (the answer lost) meets 412 against them; done, not another writer's object
        storage.put("log/z.json", [b"o", b"urs"])
        storage.create("log/z.json", b"ours")
        assert storage.get("log/z.json") == b"ours"
