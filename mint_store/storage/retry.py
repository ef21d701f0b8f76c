"""Retries of transient storage errors: what counts as transient, and bounded backoff.

The storage classes route their methods through :func:`retried` (see
``Storage.__init_subclass__``); zarr's own metadata writes go through :func:`call_with_retry`.
"""

from __future__ import annotations

import errno
import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger("mint.storage")
T = TypeVar("T")

# errnos that say "try again": an interrupted call, a busy or throttled service (s3fs turns
# S3 503/SlowDown into EBUSY, 500/InternalError into EREMOTEIO), a network hiccup. ENOSPC,
# EACCES, EROFS, EIO and the like are not here: waiting does not fix them.
TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name) for name in (
        "EINTR", "EAGAIN", "EWOULDBLOCK", "EBUSY", "ETIMEDOUT", "ECONNRESET", "ECONNABORTED", "ECONNREFUSED",
        "EPIPE", "ENETDOWN", "ENETUNREACH", "EHOSTUNREACH", "EREMOTEIO",
    ) if hasattr(errno, name)
)
# exception classes (by name: botocore/aiohttp are optional imports) of a dropped or timed-out connection
_TRANSIENT_CLASSES = frozenset({
    "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError",
    "IncompleteRead", "FSTimeoutError",
})
_TRANSIENT_S3_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError", "ServiceUnavailable",
    "RequestLimitExceeded", "503", "500",
})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter for transient storage errors.

    Parameters
    ----------
    attempts : int
        Calls in all (1 = no retry).
    base_s, max_s : float
        The n-th retry sleeps a random time in ``[0, min(max_s, base_s * 2**n)]``.
    """

    attempts: int = 5
    base_s: float = 0.05
    max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_s < 0 or self.max_s < self.base_s:
            raise ValueError("RetryPolicy needs attempts >= 1 and 0 <= base_s <= max_s")

    def delay(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (0-based)."""
        return random.uniform(0, min(self.max_s, self.base_s * 2**retry))


def is_transient(exc: BaseException) -> bool:
    """True for errors that a retry after a pause can cure (see TRANSIENT_ERRNOS)."""
    if isinstance(exc, FileNotFoundError | FileExistsError | PermissionError | IsADirectoryError):
        return False
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
        return True
    if any(cls.__name__ in _TRANSIENT_CLASSES for cls in type(exc).__mro__):
        return True
    response = getattr(exc, "response", None)  # a botocore ClientError s3fs did not translate
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in _TRANSIENT_S3_CODES or (isinstance(status, int) and status >= 500)
    return False


_RETRYING = threading.local()


def call_with_retry(policy: RetryPolicy, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, retried on transient errors per ``policy``.

    Nested calls (a storage method calling another) retry only at the outermost level,
    so attempts never multiply.
    """
    if getattr(_RETRYING, "active", False):
        return fn(*args, **kwargs)
    _RETRYING.active = True
    try:
        for retry in range(policy.attempts):
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if retry + 1 >= policy.attempts or not is_transient(e):
                    raise
                pause = policy.delay(retry)
                log.warning("transient storage error in %s (%r); retry %d/%d in %.3f s",
                            getattr(fn, "__name__", fn), e, retry + 1, policy.attempts - 1, pause)
                time.sleep(pause)
        raise AssertionError("unreachable")
    finally:
        _RETRYING.active = False


def retried(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        return call_with_retry(self.retry, method, self, *args, **kwargs)

    wrapper.__mint_retried__ = True  # type: ignore[attr-defined]
    return wrapper
