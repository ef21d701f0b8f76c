"""Any fsspec filesystem as storage (s3fs for ``s3://``): create-only and compare-and-swap PUTs."""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import threading
import uuid
from typing import Any

import fsspec
import zarr.storage

from ..errors import BlobNotFound, ObjectChanged, ObjectExists, ReadOnlyStore
from ..format.keys import check_relative_key
from .base import Storage, joined_bytes

_MEMORY_CAS = threading.Lock()  # memory:// is one process's: check-then-write under it is atomic

READ_PART_BYTES = 8 * 2**20  # a large read goes as ranged GETs of at most this many bytes each
READ_CONCURRENCY = 16  # ... at most this many in flight at once
MIN_READ_PART_BYTES = 64 * 2**10
MAX_READ_CONCURRENCY = 256
_BOTOCORE_POOL = 10  # botocore's default max_pool_connections


def read_options(storage_options: dict[str, Any]) -> tuple[int, int]:
    """Take MinT's read options out of ``storage_options`` (the rest go to fsspec): ``(part
    bytes, concurrency)``, validated; ValueError naming the option for a bad value."""
    part = storage_options.pop("read_part_bytes", READ_PART_BYTES)
    conc = storage_options.pop("read_concurrency", READ_CONCURRENCY)
    if not isinstance(part, int) or isinstance(part, bool) or part < MIN_READ_PART_BYTES:
        raise ValueError(f"storage option read_part_bytes must be an integer of at least {MIN_READ_PART_BYTES} "
                         f"(64 KiB), not {part!r}")
    if not isinstance(conc, int) or isinstance(conc, bool) or not 1 <= conc <= MAX_READ_CONCURRENCY:
        raise ValueError(f"storage option read_concurrency must be an integer in 1..{MAX_READ_CONCURRENCY} "
                         f"(1: every read is one GET), not {conc!r}")
    return part, conc


def read_parts(nbytes: int, part: int) -> builtins.list[tuple[int, int]]:
    """``(start, stop)`` of the ranged GETs of a read of ``nbytes``: as few as hold at most
    ``part`` bytes each, of even sizes (the last GET is not a sliver that arrives first)."""
    count = -(-nbytes // part)
    step = -(-nbytes // count)
    return [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)]


class _ShortRead(Exception):
    """A GET answered fewer bytes than its range: the object is shorter than the read."""


class FsspecStorage(Storage):
    """Any fsspec filesystem; s3fs for ``s3://``. A completed PUT is durable.

    ``storage_options`` go to fsspec (s3fs: ``key``, ``secret``, ``client_kwargs``, ...),
    except MinT's own read options, taken out first:

    ``read_part_bytes`` (default 8 MiB, at least 64 KiB), ``read_concurrency`` (default 16, 1..256)
        A :meth:`read_into` of at least two parts (16 MiB by default: a large row) on an async
        filesystem (s3fs, HTTP) goes as concurrent ranged GETs of at most ``read_part_bytes``
        each, up to ``read_concurrency`` of them in flight at once, each part copied into its
        slice of the caller's buffer as it lands (one copy per byte from the client's
        response, as with one GET; the row is never assembled elsewhere, and at most
        ``read_concurrency`` parts are held at once). On S3 one GET streams at one
        connection's rate; parts on several connections add up. Smaller reads,
        and every read on a filesystem that is not async (``memory://``, ``file://``), are
        one GET. ``read_concurrency=1`` makes every read one GET. (s3fs's own
        ``max_concurrency`` applies to whole-object reads and uploads, not to these.)
        On S3 the client's connection pool (botocore's ``max_pool_connections``, default 10)
        is raised to ``read_concurrency`` unless ``config_kwargs`` sets it.
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        opts = dict(storage_options or {})
        self.read_part_bytes, self.read_concurrency = read_options(opts)
        protocol = url.split("://", 1)[0]
        if protocol == "s3":
            # listings must never come from a stale cache: replay probes for new log objects
            opts.setdefault("use_listings_cache", False)
            # one connection per part in flight: parts beyond the pool would wait for one
            config = dict(opts.get("config_kwargs") or {})
            if "max_pool_connections" not in config and self.read_concurrency > _BOTOCORE_POOL:
                config["max_pool_connections"] = self.read_concurrency
                opts["config_kwargs"] = config
        self._opts = opts
        self.fs, self._root = fsspec.core.url_to_fs(self.url, **opts)
        self._root = self._root.rstrip("/")
        self._s3 = hasattr(self.fs, "_call_s3")
        # ranged GETs in parallel need the filesystem's async calls, run on its own loop (an
        # instance made for use inside coroutines, asynchronous=True, has no loop of its own)
        self._parallel = (self.read_concurrency > 1 and bool(getattr(self.fs, "async_impl", False))
                          and not getattr(self.fs, "asynchronous", False) and hasattr(self.fs, "_cat_file"))
        # memory:// lives in this process: one lock for all of it makes check-then-write atomic
        # (every storage object on it, not only this one). Other filesystems have no
        # conditional write: exists-then-put by two machines could both "create" one log seq
        self._memory = protocol == "memory"

    def _path(self, key: str) -> str:
        # every key reaches the bucket through here: an absolute key, a ".." or a backslash could
        # name an object outside the prefix (s3fs and fsspec normalise some of them), so they are
        # refused (a second line of defence behind mint_store.format.keys)
        return f"{self._root}/{check_relative_key(key)}"

    def _cas(self) -> threading.Lock:
        """The lock that makes a conditional write atomic where no server offers one; refused elsewhere."""
        if not self._memory:
            raise ReadOnlyStore(f"{self.url}: this filesystem has no conditional writes (create-only, compare-and-"
                                "swap), so two writers on it could both commit: open the store read-only, or keep "
                                "it in a local directory or on S3 (s3://)")
        return _MEMORY_CAS

    def zarr_store(self) -> Any:
        return zarr.storage.FsspecStore.from_url(self.url, storage_options=self._opts)

    def put(self, key: str, data: Any) -> None:
        self.fs.pipe_file(self._path(key), joined_bytes(data))

    def put_if_absent(self, key: str, data: Any) -> None:
        # S3: PutObject with If-None-Match: * (s3fs's mode="create"); a 412 is FileExistsError
        try:
            if self._s3:
                self.fs.pipe_file(self._path(key), joined_bytes(data), mode="create")
                return
            with self._cas():
                if self.exists(key):
                    raise FileExistsError(key)
                self.put(key, data)
        except FileExistsError:
            raise ObjectExists(f"object {key!r} already exists in {self.url}; not overwritten") from None

    def get_with_token(self, key: str) -> tuple[bytes, str]:
        if not self._s3:
            data = self.get(key)
            return data, hashlib.sha256(data).hexdigest()
        from fsspec.asyn import sync

        bucket, name, _ = self.fs.split_path(self._path(key))

        async def fetch() -> tuple[bytes, str]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=name)
            return bytes(await resp["Body"].read()), str(resp["ETag"])

        try:
            return sync(self.fs.loop, fetch)
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def replace_if(self, key: str, data: Any, token: str) -> None:
        if not self._s3:
            with self._cas():
                try:
                    current: str | None = self.get_with_token(key)[1]
                except BlobNotFound:
                    current = None
                if current != token:
                    raise ObjectChanged(f"object {key!r} changed since it was read; not overwritten")
                self.put(key, data)
            return
        body = joined_bytes(data)
        try:  # PutObject with If-Match: the ETag we read
            self.fs.pipe_file(self._path(key), body, IfMatch=token)
        except (OSError, FileNotFoundError) as e:
            if not _precondition_failed(e):
                raise
            # s3fs retries a request by itself: its retry of our PUT that landed (the answer
            # lost) fails the precondition against our own object. Ours is there: done. (A
            # lease record names its holder and expiry: nobody else writes the same bytes.)
            try:
                if self.get(key) == body:
                    return
            except BlobNotFound:
                pass
            raise ObjectChanged(f"object {key!r} changed since it was read; not overwritten") from None

    def check_conditional_writes(self) -> None:
        """Create-only and compare-and-swap tried once on a scratch object: both must be refused.

        s3fs sends ``If-None-Match: *`` and ``If-Match``, but an S3-compatible service that
        ignores them turns both into plain overwrites, and then two writers (a standby taking
        over, a writer paused past its lease) both "create" one log seq: the first one's
        acknowledged commit is silently replaced. So a writer opens only where they hold."""
        if not self._s3:
            self._cas()  # memory:// (exact, in-process) or refused
            return
        key = f"probes/{uuid.uuid4().hex}"
        broken = None
        try:
            self.put_if_absent(key, b"1")
            try:
                self.put_if_absent(key, b"2")
                broken = "a create-only PUT (If-None-Match: *) overwrote an existing object"
            except ObjectExists:
                _, token = self.get_with_token(key)
                self.put(key, b"3")  # the object changes under the token
                try:
                    self.replace_if(key, b"4", token)
                    broken = "a compare-and-swap PUT (If-Match) overwrote an object that had changed"
                except ObjectChanged:
                    pass
        finally:
            try:
                self.delete(key)
            except Exception:  # a scratch object left behind is harmless
                pass
        if broken is not None:
            raise ReadOnlyStore(f"{self.url}: this object store ignores conditional writes ({broken}), so two "
                                "writers on it could both commit one log entry: open the store read-only, or keep "
                                "it on a service that honours If-None-Match and If-Match (AWS S3 does)")

    def _s3_call(self, method: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, self.fs._call_s3, method, **kwargs)

    def incomplete_uploads(self) -> builtins.list[tuple[str, str, float]]:
        if not self._s3:
            return []
        bucket, prefix, _ = self.fs.split_path(self._root + "/")
        out: builtins.list[tuple[str, str, float]] = []
        marker: dict[str, str] = {}
        while True:  # a page at a time (1,000 uploads each)
            got = self._s3_call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **marker)
            for u in got.get("Uploads", []):
                key = u["Key"][len(prefix):] if u["Key"].startswith(prefix) else u["Key"]
                out.append((key, u["UploadId"], u["Initiated"].timestamp()))
            if not got.get("IsTruncated"):
                return out
            marker = {"KeyMarker": got["NextKeyMarker"], "UploadIdMarker": got["NextUploadIdMarker"]}

    def abort_upload(self, key: str, upload_id: str) -> None:
        if not self._s3:
            return
        bucket, name, _ = self.fs.split_path(self._path(key))
        try:
            self._s3_call("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload_id)
        except FileNotFoundError:  # completed or aborted meanwhile
            pass

    def get(self, key: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._path(key)))
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def exists(self, key: str) -> bool:
        try:
            self.fs.info(self._path(key))
            return True
        except FileNotFoundError:
            return False

    def size(self, key: str) -> int:
        try:
            return int(self.fs.size(self._path(key)))
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None

    def modified(self, key: str) -> float | None:
        try:
            info = self.fs.info(self._path(key))
        except FileNotFoundError:
            return None
        stamp = info.get("LastModified", info.get("mtime", info.get("created")))  # s3fs, local, memory://
        if hasattr(stamp, "timestamp"):  # a datetime (S3's Last-Modified, memory://'s created)
            return float(stamp.timestamp())
        return float(stamp) if isinstance(stamp, (int, float)) else None

    def read_into(self, key: str, offset: int, buf: memoryview) -> None:
        if offset < 0:  # (fsspec would read from the end, as a local pread refuses)
            raise ValueError(f"offset {offset} < 0")
        if not len(buf):
            if not self.exists(key):
                raise BlobNotFound(f"object {key!r} not found in {self.url}")
            return
        path = self._path(key)
        try:
            if self._parallel and len(buf) >= 2 * self.read_part_bytes:
                self._read_parts(path, offset, buf)
            else:
                data = self.fs.cat_file(path, start=offset, end=offset + len(buf))
                if len(data) != len(buf):
                    raise _ShortRead
                buf[:] = data
        except FileNotFoundError:
            raise BlobNotFound(f"object {key!r} not found in {self.url}") from None
        except _ShortRead:
            raise BlobNotFound(f"object {key!r} is shorter than {offset + len(buf)} bytes") from None
        except OSError as e:  # a range past the end (S3: 416 InvalidRange), as a short object on disk
            if range_not_satisfiable(e):
                raise BlobNotFound(f"object {key!r} is shorter than {offset + len(buf)} bytes") from None
            raise

    def _read_parts(self, path: str, offset: int, buf: memoryview) -> None:
        """``buf`` from ``offset`` of ``path`` as concurrent ranged GETs (:func:`read_parts`) on
        the filesystem's loop, each part copied into its slice of ``buf`` as it arrives.

        The first error cancels the GETs still in flight; every one has ended (none can
        still write into ``buf``) before this returns or raises."""
        from fsspec.asyn import sync

        fs = self.fs
        spans = read_parts(len(buf), self.read_part_bytes)
        parts = iter(spans)
        workers = min(self.read_concurrency, len(spans))

        async def worker() -> None:
            for lo, hi in parts:  # (one loop thread: the workers share the iterator safely)
                data = await fs._cat_file(path, start=offset + lo, end=offset + hi)
                if len(data) != hi - lo:
                    raise _ShortRead
                buf[lo:hi] = data

        async def run() -> None:
            tasks = [asyncio.ensure_future(worker()) for _ in range(workers)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        sync(fs.loop, run)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def list(self, prefix: str) -> builtins.list[str]:
        try:
            found = self.fs.find(f"{self._root}/{check_relative_key(prefix, prefix=True)}")
        except FileNotFoundError:
            return []
        n = len(self._root) + 1
        return sorted(p[n:] for p in found)


def range_not_satisfiable(e: BaseException) -> bool:
    """s3fs's error for a range that starts past the object's end (416), however it words it."""
    text = str(e).lower()
    return getattr(e, "errno", None) == 22 and (("range" in text and "satisf" in text) or "invalidrange" in text)


def _precondition_failed(e: BaseException) -> bool:
    """Whether an s3fs error is S3's 412 PreconditionFailed (or 404 on If-Match of a gone key)."""
    cause = e.__cause__ or e.__context__
    resp = getattr(cause, "response", None)
    if isinstance(resp, dict):
        code = str(resp.get("Error", {}).get("Code", ""))
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in ("PreconditionFailed", "NoSuchKey", "412") or status in (404, 412)
    return isinstance(e, FileNotFoundError) or "pre-condition" in str(e).lower()
