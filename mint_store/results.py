"""Value objects the store hands out: row locations, version metadata, publish results."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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


_new = object.__new__
_SET = tuple(Location.__dict__[f].__set__ for f in ("content_id", "layout_id", "shard_key", "offset", "length", "row"))


def make_location(content_id: str, layout_id: str, shard_key: str, offset: int, length: int, row: int) -> Location:
    """``Location(...)`` for the resolve hot path: the frozen dataclass's ``__init__`` costs an
    ``object.__setattr__`` call per field, half the time this takes."""
    loc = _new(Location)
    s0, s1, s2, s3, s4, s5 = _SET
    s0(loc, content_id)
    s1(loc, layout_id)
    s2(loc, shard_key)
    s3(loc, offset)
    s4(loc, length)
    s5(loc, row)
    return loc


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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], tags: Iterable[str] | None = None) -> VersionInfo:
        """From a version record of the index or its JSON form (:meth:`to_dict`, the service's answer).

        ``tags`` (the index keeps them apart from the version record) overrides ``d["tags"]``.
        """
        return cls(
            d["tenant"], d["name"], int(d["version"]), d["content_id"], d["layout_id"], int(d["nbytes"]), d["base"],
            float(d["created"]), bool(d["deleted"]), bool(d["deduplicated"]),
            tuple(d.get("tags", ()) if tags is None else tags), d.get("peft_config"),
        )

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
