"""The web console at ``/ui/``: static files shipped in the package (no build step, no CDN).

The page itself is public (it holds no data); every datum it shows comes from the JSON
API with the token pasted into it, so it sees exactly what the API lets that token see.
"""

from __future__ import annotations

import functools
from importlib import resources

from aiohttp import web

from .errors import RouteNotFound

CONSOLE_PATHS = frozenset({"/ui", "/ui/", "/ui/{asset}"})
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
# the page runs only its own files and talks only to its own origin; no inline script can
# run even if some data slipped into the DOM as markup, and the sign-in form cannot be submitted
# natively (which would put the token in a URL)
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

routes = web.RouteTableDef()


@functools.cache
def _assets() -> dict[str, tuple[bytes, str]]:
    """The console's files by name (a fixed set: request paths never reach the filesystem)."""
    root = resources.files(__package__) / "console"
    out: dict[str, tuple[bytes, str]] = {}
    for item in root.iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1]
        if item.is_file() and suffix in _TYPES:
            out[item.name] = (item.read_bytes(), _TYPES[suffix])
    return out


def _send(name: str) -> web.Response:
    found = _assets().get(name)
    if found is None:
        raise RouteNotFound(f"no console file {name!r}; the console is at /ui/")
    body, content_type = found
    return web.Response(body=body, content_type=content_type, charset="utf-8", headers=_HEADERS)


@routes.get("/ui", allow_head=False)
async def console_redirect(request: web.Request) -> web.Response:
    # relative: also right behind a proxy that mounts the service under a prefix
    return web.Response(status=302, headers={"Location": "ui/"})


@routes.get("/ui/", allow_head=False)
async def console_index(request: web.Request) -> web.Response:
    return _send("index.html")


@routes.get("/ui/{asset}", allow_head=False)
async def console_asset(request: web.Request) -> web.Response:
    return _send(request.match_info["asset"])


def setup_console(app: web.Application) -> None:
    """Serve the console at ``/ui/`` (its paths are public, see ``CONSOLE_PATHS``)."""
    app.add_routes(routes)
