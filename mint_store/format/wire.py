"""The wire format of errors, shared by the service and its clients: ``{"error": code, "message": ...}``.

Every :class:`~mint_store.errors.MintError` has a ``code``; this module holds the errors that
exist only on the wire (HTTP-only conditions, and the client's own), the body an error
becomes, and the way back from a body to the typed error. Import-light on purpose (no
aiohttp): the client imports it. Which HTTP status each error gets is the service's
business (``mint_store/service/errors.py``).
"""

from __future__ import annotations

from typing import Any

from .. import errors as E


class HTTPOnlyError(E.MintError):
    """An error that exists only at the HTTP layer. ``status`` is fixed per class;
    ``headers`` go out with the error response (``Allow``, ``Content-Range``)."""

    status = 500

    def __init__(self, message: str = "", *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})


class BadRequest(HTTPOnlyError, ValueError):
    """Malformed request: bad JSON, bad query parameter, malformed or truncated multipart."""

    code = "bad_request"
    status = 400


class Unauthorized(HTTPOnlyError, PermissionError):
    code = "unauthorized"
    status = 401


class Forbidden(HTTPOnlyError, PermissionError):
    code = "forbidden"
    status = 403


class MisdirectedRequest(HTTPOnlyError):
    """A ``Host`` this server does not answer to (no token file: loopback names only)."""

    code = "misdirected_request"
    status = 421


class RouteNotFound(HTTPOnlyError, LookupError):
    code = "route_not_found"
    status = 404


class MethodNotAllowed(HTTPOnlyError):
    code = "method_not_allowed"
    status = 405


class RequestTimeout(HTTPOnlyError, TimeoutError):
    code = "request_timeout"
    status = 408


class BodyTooLarge(E.LimitExceeded):
    """The request body (or one multipart part) is over the configured limit."""

    code = "body_too_large"


class UnsupportedMediaType(HTTPOnlyError):
    code = "unsupported_media_type"
    status = 415


class RangeNotSatisfiable(HTTPOnlyError):
    code = "range_not_satisfiable"
    status = 416


class NotImplementedYet(HTTPOnlyError):
    code = "not_implemented"
    status = 501


class ServiceUnavailable(HTTPOnlyError):
    """The server is shutting down or its store stopped; nothing was committed."""

    code = "service_unavailable"
    status = 503


class HubNotFound(HTTPOnlyError, LookupError):
    """A 404 of the Hugging Face Hub routes (``/hf``). ``X-Error-Code`` is the header the
    ``huggingface_hub`` client maps to its own error class."""

    status = 404
    hub_code = ""

    def __init__(self, message: str = "", *, headers: dict[str, str] | None = None) -> None:
        printable = "".join(c if " " <= c <= "~" else "?" for c in message)[:300]  # a header value
        super().__init__(message, headers={"X-Error-Code": self.hub_code, "X-Error-Message": printable,
                                           **(headers or {})})


class HubRepoNotFound(HubNotFound):
    """No such repo, or one of a tenant the token does not hold (the same answer: as on the Hub)."""

    code = "repo_not_found"
    hub_code = "RepoNotFound"


class HubRevisionNotFound(HubNotFound):
    code = "revision_not_found"
    hub_code = "RevisionNotFound"


class HubEntryNotFound(HubNotFound):
    code = "entry_not_found"
    hub_code = "EntryNotFound"


class ConnectionFailed(E.MintError, ConnectionError):
    """Client side: the server could not be reached (after retries)."""

    code = "connection_failed"


class HTTPError(E.MintError):
    """Client side: an error response whose code this build does not know."""

    code = "http_error"

    def __init__(self, message: str, *, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


def error_body(err: BaseException) -> dict[str, Any]:
    code = getattr(err, "code", "internal_error") if isinstance(err, E.MintError) else "internal_error"
    message = str(err) if isinstance(err, E.MintError) else "internal server error"
    body: dict[str, Any] = {"error": code, "message": message}
    if isinstance(err, E.NotTheWriter) and err.writer_url:  # where writes go (also in Location)
        body["writer_url"] = err.writer_url
    return body


def headers_for(err: BaseException, path_qs: str) -> dict[str, str]:
    """Headers an error answer carries besides its status: a replica's 405 names the writer."""
    if isinstance(err, E.NotTheWriter) and err.writer_url:
        return {"Location": err.writer_url.rstrip("/") + path_qs}
    return {}


def _codes() -> dict[str, type[E.MintError]]:
    out: dict[str, type[E.MintError]] = {}
    todo: list[type[E.MintError]] = [E.MintError]
    while todo:
        cls = todo.pop()
        out.setdefault(cls.code, cls)
        todo.extend(cls.__subclasses__())
    return out


# Codes whose retry cannot help: the client never retries them, even on a 5xx.
TERMINAL_CODES = frozenset({"integrity_error", "damaged", "read_only", "not_the_writer", "not_implemented",
                            "commit_in_doubt"})  # (a resent publish could commit twice)


def error_from_body(status: int, body: Any) -> E.MintError:
    """The typed error an error response stands for (client side)."""
    code = body.get("error") if isinstance(body, dict) else None
    message = body.get("message") if isinstance(body, dict) else None
    text = str(message or f"HTTP {status}")
    cls = _codes().get(code) if isinstance(code, str) else None
    if cls is None or cls is HTTPError:
        return HTTPError(f"{text} ({code or 'no error code'})", status=status)
    if issubclass(cls, E.NotTheWriter):
        url = body.get("writer_url")
        return cls(text, writer_url=url if isinstance(url, str) else None)
    err = cls(text)
    return err
