"""The ``mint`` CLI's commands over a running service (``--server URL``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mint_store.format.names import parse_ref

from .mint_client import SyncMintClient


class RemoteBackend:
    """Same results as the CLI's local backend, through the HTTP API."""

    def __init__(self, url: str, *, token: str | None) -> None:
        self.client = SyncMintClient(url, token=token)

    def publish(self, path: str, tenant: str, name: str, *, base: str | None, tag: str | None) -> dict[str, Any]:
        return self.client.publish(tenant, name, path, base=base, tag=tag).to_dict()

    def ls(self, tenant: str | None) -> list[Any]:
        if tenant is None:
            return self.client.tenants()  # the tenants this token may read
        from mint_store.cli.commands import list_adapters

        return list(list_adapters(self.client, tenant))

    def show(self, ref: str) -> dict[str, Any]:
        return self.client.version(ref).to_dict()

    def pull(self, ref: str, out: str) -> dict[str, Any]:
        if ref.startswith("sha:"):
            return {"content_id": ref[4:], "path": str(Path(self.client.pull(ref, out)).resolve())}
        info = self.client.version(ref)  # once: the files written and the version reported are one
        path = self.client.pull(info.ref, out)
        return info.to_dict() | {"path": str(Path(path).resolve())}

    def tag(self, ref: str, tag: str) -> dict[str, Any]:
        r = parse_ref(ref)
        return {"tenant": r.tenant, "name": r.name, "version": self.client.tag(ref, tag), "tag": tag}

    def rm(self, ref: str) -> dict[str, Any]:
        r = parse_ref(ref)
        return {"tenant": r.tenant, "name": r.name, "version": self.client.delete(ref), "deleted": True}

    def register_base(self, base: str, shapes: dict[str, list[int]]) -> None:
        self.client.register_base(base, shapes)

    def bases(self) -> dict[str, int]:
        return self.client.bases()

    def close(self) -> None:
        self.client.close()
