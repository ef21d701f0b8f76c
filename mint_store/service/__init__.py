"""The HTTP service (aiohttp). ``create_app(ServiceConfig(...))`` or ``run_server(config)``.

Exports load lazily so that importing ``mint_store.service.errors`` (or any small module here) does not
pull in the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import RunningServer, ServerThread, create_app, run_server, serve, start_server
    from .config import ServiceConfig

__all__ = ["RunningServer", "ServerThread", "ServiceConfig", "create_app", "run_server", "serve", "start_server"]


def __getattr__(name: str) -> Any:
    if name == "ServiceConfig":
        from .config import ServiceConfig

        return ServiceConfig
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
