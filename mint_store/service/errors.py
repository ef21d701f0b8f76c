"""HTTP status of every error, in one place.

The error classes that exist only on the wire, the error body and the code -> class
mapping are in :mod:`mint_store.format.wire` (the client shares them); they are re-exported here
for the service's modules.
"""

from __future__ import annotations

from .. import errors as E
from ..format.wire import (
    TERMINAL_CODES,
    BadRequest,
    BodyTooLarge,
    ConnectionFailed,
    Forbidden,
    HTTPError,
    HTTPOnlyError,
    HubEntryNotFound,
    HubNotFound,
    HubRepoNotFound,
    HubRevisionNotFound,
    MethodNotAllowed,
    MisdirectedRequest,
    NotImplementedYet,
    RangeNotSatisfiable,
    RequestTimeout,
    RouteNotFound,
    ServiceUnavailable,
    Unauthorized,
    UnsupportedMediaType,
    error_body,
    error_from_body,
    headers_for,
)

__all__ = [
    "TERMINAL_CODES",
    "BadRequest",
    "BodyTooLarge",
    "ConnectionFailed",
    "Forbidden",
    "HTTPError",
    "HTTPOnlyError",
    "HubEntryNotFound",
    "HubNotFound",
    "HubRepoNotFound",
    "HubRevisionNotFound",
    "MethodNotAllowed",
    "MisdirectedRequest",
    "NotImplementedYet",
    "RangeNotSatisfiable",
    "RequestTimeout",
    "RouteNotFound",
    "ServiceUnavailable",
    "Unauthorized",
    "UnsupportedMediaType",
    "error_body",
    "error_from_body",
    "headers_for",
    "status_for",
]


# The mapping. Order matters: the first class an error is an instance of wins.
_STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (HTTPOnlyError, 0),  # its own status
    (BodyTooLarge, 413),  # the bytes sent; an adapter over a limit (rank, size) is a 422
    (E.InvalidName, 400),
    (E.InvalidAdapter, 422),  # unsupported_adapter, base_mismatch, limit_exceeded included
    (E.StaleLocation, 404),
    (E.NotFound, 404),
    (E.VersionDeleted, 410),  # 409 for writes, see status_for
    (E.Conflict, 409),  # object_exists/object_changed never reach a client
    (E.ReadOnlyStore, 405),  # not_the_writer included: Location names the writer (headers_for)
    (E.WriterLocked, 503),
    (E.WriterFenced, 503),  # commit_conflict included: nothing was committed
    (E.StoreClosed, 503),
    (E.StoreUnavailable, 503),
    (E.IntegrityError, 500),  # damaged included; never retried by the client (typed code)
)


def status_for(err: BaseException, method: str = "GET") -> int:
    """The HTTP status for ``err`` answering a request with ``method``."""
    if isinstance(err, E.VersionDeleted) and method not in ("GET", "HEAD"):
        return 409  # tagging or deleting a deleted version conflicts with its state
    for cls, status in _STATUS:
        if isinstance(err, cls):
            return status or int(getattr(err, "status", 500))
    return 500
