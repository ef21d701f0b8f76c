"""Value objects the store hands out."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Location:
    """Where one row lives: enough to read it with one call and verify it."""

    content_id: str
    layout_id: str
    shard_key: str
    offset: int
    length: int
    row: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class VersionInfo:
    tenant: str
    name: str
    version: int
    content_id: str
    layout_id: str
    nbytes: int
    base: str
    created: float
    deleted: bool
    deduplicated: bool  # its tenant already held these bytes (another tenant's never count)
    tags: tuple[str, ...] = ()
    peft_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def ref(self) -> str:
        return f"{self.tenant}/{self.name}@{self.version}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("peft_config")
        d["tags"] = list(self.tags)
        return d


@dataclass(frozen=True, slots=True)
class PublishResult:
    tenant: str
    name: str
    version: int
    content_id: str
    layout_id: str
    nbytes: int
    deduplicated: bool  # this tenant already held these bytes (another tenant's never count)
    seq: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
