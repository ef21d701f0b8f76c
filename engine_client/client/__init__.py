"""``MintClient``: one async interface over the HTTP service (pooled, retried) or a store opened
in this process, its blocking twin ``SyncMintClient``, and the ``mint --server`` backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mint_store._lazy import lazy_exports

if TYPE_CHECKING:
    from .cli_backend import RemoteBackend
    from .http_transport import HttpMintClient
    from .local_transport import StoreMintClient
    from .mint_client import ClientConfig, EventBatch, MintClient, SyncMintClient

_EXPORTS = {
    "ClientConfig": ".mint_client",
    "EventBatch": ".mint_client",
    "HttpMintClient": ".http_transport",
    "MintClient": ".mint_client",
    "RemoteBackend": ".cli_backend",
    "StoreMintClient": ".local_transport",
    "SyncMintClient": ".mint_client",
}

__all__ = [
    "ClientConfig",
    "EventBatch",
    "HttpMintClient",
    "MintClient",
    "RemoteBackend",
    "StoreMintClient",
    "SyncMintClient",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
