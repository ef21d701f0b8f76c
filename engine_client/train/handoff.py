"""The trainer's handoff to serving: publish each policy as a new version and move its tag (an
engine or vLLM following the tag swaps to it), and roll a tag back. Half of
:class:`~engine_client.train.trainer.MultiLoRATrainer`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mint_store import PublishResult
from mint_store.format.adapter import Adapter

from ..client.mint_client import SyncMintClient
from ..errors import NoVersionToRollBack, TrainerError
from .trainer_types import Policy, TrainerConfig


class Handoff:
    config: TrainerConfig
    _policies: dict[str, Policy]
    _tp: Any

    def policy(self, name: str) -> Policy:
        raise NotImplementedError

    def adapter(self, name: str) -> Adapter:
        raise NotImplementedError

    def load_weights(self, name: str, source: Adapter | str) -> None:
        raise NotImplementedError

    def _need_client(self, what: str) -> SyncMintClient:
        raise NotImplementedError

    def publish(self, names: Iterable[str] | None = None) -> dict[str, PublishResult]:
        """Publish each policy (default: all) as a new version of its ``tenant/name``; move the tag.

        Returns
        -------
        dict[str, PublishResult]
            Each published policy's new version.

        Raises
        ------
        TrainerError
            The trainer has no client.
        """
        if self._tp is not None and self._tp.rank != 0:
            return {}  # every rank holds the same full policies: rank 0 publishes them
        client = self._need_client("publish")
        out = {}
        pols = [self.policy(n) for n in (list(self._policies) if names is None else list(names))]  # all, first
        for pol in pols:
            name = pol.name
            res = client.publish(pol.tenant, pol.adapter_name, self.adapter(name), tag=self.config.tag)
            pol.versions.append(res.version)
            out[name] = res
        return out

    def rollback(self, name: str, version: int | None = None, *, restore: bool = False) -> int:
        """Move the tag of ``name`` back to ``version`` (default: the newest one before the tagged one).

        With ``restore``, training continues from that version's weights (moments reset).
        Returns the version the tag now names.
        """
        client = self._need_client("roll back")
        tag = self.config.tag
        if tag is None:
            raise TrainerError("this trainer moves no tag (tag=None): nothing to roll back")
        pol = self.policy(name)
        if version is None:
            current = client.version(f"{name}:{tag}").version
            older = [v.version for v in client.versions(pol.tenant, pol.adapter_name)
                     if v.version < current and not v.deleted]
            if not older:
                raise NoVersionToRollBack(f"{name}:{tag} is version {current}; there is no earlier live version")
            version = max(older)
        client.tag(f"{name}@{version}", tag)
        if restore:
            self.load_weights(name, f"{name}@{version}")
        return version
