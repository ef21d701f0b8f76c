"""Without a token file every request acts as admin: only this machine may make them.

Binding a loopback address keeps other machines out, but not a web page in a browser on
this machine: through DNS rebinding (a name of the attacker's that resolves to 127.0.0.1)
or a plain cross-origin ``fetch``, the browser would send requests that act as admin. So,
in no-token mode, a request must name a loopback host in ``Host`` (a rebound name is not
one: 421 ``misdirected_request``), and a write (any method but GET/HEAD/OPTIONS) that
carries an ``Origin`` must come from this server's own loopback origin (403 ``forbidden``).
Clients that are not browsers (curl, the engine client) send no ``Origin`` and a
loopback ``Host``: nothing changes for them.
"""

from __future__ import annotations

from aiohttp import web
from yarl import URL

from .config import is_loopback
from .errors import Forbidden, MisdirectedRequest

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _hostname(host: str) -> str:
    """``127.0.0.1:8470`` -> ``127.0.0.1``; ``[::1]:8470`` -> ``::1``; ``localhost`` as is."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def check_loopback_request(request: web.Request) -> None:
    """Refuse what a browser page could send to a no-token server (see the module doc)."""
    host = request.headers.get("Host")
    if host is not None and not is_loopback(_hostname(host.strip().lower())):
        raise MisdirectedRequest(
            f"this server has no token file and answers loopback names only (127.0.0.1, localhost, [::1]), "
            f"not Host {host!r}; serve with --tokens to be reached by other names"
        )
    origin = request.headers.get("Origin")
    if origin is None or request.method in _SAFE_METHODS:
        return
    if not _own_origin(request, origin):
        raise Forbidden(
            f"cross-origin write refused: Origin {origin!r} is not this server's loopback origin "
            "(a server without a token file takes writes from this machine's own clients only)"
        )


def _own_origin(request: web.Request, origin: str) -> bool:
    try:
        url = URL(origin.strip())
    except ValueError:
        return False
    if url.scheme != "http" or not url.host or not is_loopback(url.host.lower()):
        return False
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return isinstance(sockname, tuple) and url.port == sockname[1]
