"""A MinT adapter seen as a Hugging Face Hub model repo: revisions, commit ids, files, model card.

Pure (no aiohttp, no store): :mod:`.routes` serves what this module describes.

* Repo ``tenant/name``; one commit per stored version. A commit id is 40 hex digits (the
  Hub client checks that form), the SHA-1 of the version's name, number, content id and
  PEFT config: stable across restarts and replicas, and never reused for other bytes.
* Revisions: ``main`` is the latest live version, ``v7`` or ``7`` version 7, a version's
  commit id that version, anything else a tag. Numbers win over a tag of the same spelling.
* Files: ``adapter_config.json`` and ``adapter_model.safetensors`` (what ``mint pull``
  writes) and a ``README.md`` model card. The weights are served like a Git LFS file on the
  Hub: ETag (and ``X-Linked-Etag``) is their SHA-256; other files' ETag is their git blob id.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ...errors import InvalidName
from ...format.adapter import UNSPECIFIED_BASE, Adapter
from ...format.names import check_name, check_version
from ...peft.adapter_config import CONFIG_NAME
from ...peft.directory import WEIGHTS_NAME
from ...results import VersionInfo
from ..errors import HubRevisionNotFound

README_NAME = "README.md"
FILES = (CONFIG_NAME, WEIGHTS_NAME, README_NAME)
LATEST = "main"
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_VERSION_RE = re.compile(r"v?([0-9]{1,16})")
_CONTENT_TYPES = {CONFIG_NAME: "application/json", WEIGHTS_NAME: "application/octet-stream",
                  README_NAME: "text/markdown; charset=utf-8"}


@dataclass(frozen=True, slots=True)
class Revision:
    """A parsed revision: ``latest``; ``version`` (a number); ``commit`` (which may also be a
    tag's spelling: ``tag`` is set then); ``tag``."""

    kind: str
    version: int | None = None
    commit: str | None = None
    tag: str | None = None


def parse_revision(text: str) -> Revision:
    """The revision a client asked for, or HubRevisionNotFound for one no version can have."""
    if text == LATEST:
        return Revision("latest")
    m = _VERSION_RE.fullmatch(text)
    if m is not None:
        try:
            return Revision("version", version=check_version(m.group(1)))
        except InvalidName:
            raise HubRevisionNotFound(f"revision {text!a}: versions are integers >= 1") from None
    tag: str | None
    try:
        tag = check_name(text, "tag")
    except InvalidName:
        tag = None
    if _COMMIT_RE.fullmatch(text):
        return Revision("commit", commit=text, tag=tag)
    if tag is None:
        raise HubRevisionNotFound(
            f"revision {text!a} is not 'main', a version (7 or v7), a commit id or a tag")
    return Revision("tag", tag=tag)


def commit_id(tenant: str, name: str, version: int, content_id: str, peft_config: Any = None) -> str:
    """The 40-hex commit id of a version (stable: a function of what the version is).

    The config is part of it: the same tensors published with another config (PEFT writes
    ``target_modules`` in set order) are other files, so another commit, also across stores
    that share a client cache.
    """
    config = json.dumps(peft_config, separators=(",", ":"))
    return hashlib.sha1(f"mint-hub/1\0{tenant}/{name}@{version}\0{content_id}\0{config}".encode()).hexdigest()


def commit_of(info: VersionInfo) -> str:
    return commit_id(info.tenant, info.name, info.version, info.content_id, info.peft_config)


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's bytes (what the Hub reports as a file's ``oid``)."""
    h = hashlib.sha1(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class HubFile:
    """One file of a commit. ``etag`` is unquoted; ``lfs_sha256`` is set for the weights."""

    name: str
    data: bytes
    etag: str
    lfs_sha256: str | None = None

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def content_type(self) -> str:
        return _CONTENT_TYPES[self.name]

    def tree_entry(self) -> dict[str, Any]:
        """The file as ``GET /api/models/{repo}/tree/{revision}`` lists it."""
        if self.lfs_sha256 is None:
            return {"type": "file", "oid": self.etag, "size": self.size, "path": self.name}
        pointer = lfs_pointer(self.lfs_sha256, self.size)
        return {"type": "file", "oid": git_blob_id(pointer), "size": self.size, "path": self.name,
                "lfs": {"oid": self.lfs_sha256, "size": self.size, "pointerSize": len(pointer)}}

    def sibling(self) -> dict[str, Any]:
        """The file as model info lists it with ``?blobs=true``."""
        out: dict[str, Any] = {"rfilename": self.name, "size": self.size, "blobId": self.tree_entry()["oid"]}
        if self.lfs_sha256 is not None:
            out["lfs"] = {"sha256": self.lfs_sha256, "size": self.size,
                          "pointerSize": len(lfs_pointer(self.lfs_sha256, self.size))}
        return out


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def config_file(data: bytes) -> HubFile:
    return HubFile(CONFIG_NAME, data, git_blob_id(data))


def weights_file(data: bytes) -> HubFile:
    sha = hashlib.sha256(data).hexdigest()
    return HubFile(WEIGHTS_NAME, data, sha, lfs_sha256=sha)


@dataclass(frozen=True, slots=True)
class Summary:
    """What the model card says about the tensors."""

    ranks: tuple[int, ...]
    targets: tuple[str, ...]
    modules: int


def summarize(adapter: Adapter) -> Summary:
    mods = adapter.modules
    return Summary(tuple(sorted({m.rank for m in mods})), tuple(sorted({m.name.rsplit(".", 1)[-1] for m in mods})),
                   len(mods))


def iso_time(ts: float) -> str:
    """The Hub's timestamp form (``2024-05-01T12:00:00.000Z``)."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _hub_tags(info: VersionInfo) -> list[str]:
    tags = ["peft", "lora", "safetensors", "mint-store"]
    if info.base != UNSPECIFIED_BASE:
        tags.append(f"base_model:adapter:{info.base}")
    return tags


def model_card(info: VersionInfo, summary: Summary, commit: str) -> HubFile:
    """``README.md``: YAML front matter the Hub's card parser reads, then a table.

    The MinT tags listed are those pointing at the version when the card is served.
    """
    meta = ["---", "library_name: peft"]
    if info.base != UNSPECIFIED_BASE:
        meta.append(f"base_model: {json.dumps(info.base)}")  # a JSON string is a YAML string
    meta += ["tags:", *(f"- {json.dumps(t)}" for t in _hub_tags(info)), "---", ""]
    rows = [
        ("base", info.base), ("version", str(info.version)), ("tags", ", ".join(info.tags) or "(none)"),
        ("rank", ", ".join(map(str, summary.ranks))), ("targets", ", ".join(summary.targets)),
        ("LoRA modules", str(summary.modules)), ("content id", f"`{info.content_id}`"),
        ("commit", f"`{commit}`"), ("published", iso_time(info.created)),
    ]
    body = [f"# {info.tenant}/{info.name}", "", "A LoRA adapter served by MinT Store.", "",
            "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows), "",
            "```python",
            "from peft import PeftModel",
            f'model = PeftModel.from_pretrained(base_model, "{info.tenant}/{info.name}", revision="{commit}")',
            "```", ""]
    data = "\n".join(meta + body).encode()
    return HubFile(README_NAME, data, git_blob_id(data))


def model_info(info: VersionInfo, commit: str, *, private: bool, files: list[HubFile] | None) -> dict[str, Any]:
    """``GET /api/models/{repo}[/revision/{revision}]``; ``files`` with sizes for ``?blobs=true``."""
    repo = f"{info.tenant}/{info.name}"
    card: dict[str, Any] = {"library_name": "peft", "tags": _hub_tags(info)}
    if info.base != UNSPECIFIED_BASE:
        card["base_model"] = info.base
    return {
        "_id": commit, "id": repo, "modelId": repo, "author": info.tenant, "sha": commit,
        "lastModified": iso_time(info.created), "createdAt": iso_time(info.created),
        "private": private, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
        "library_name": "peft", "tags": _hub_tags(info), "pipeline_tag": None, "cardData": card,
        "siblings": [f.sibling() for f in files] if files is not None else [{"rfilename": n} for n in FILES],
        "spaces": [], "usedStorage": info.nbytes,
        "mint": {"version": info.version, "content_id": info.content_id, "tags": list(info.tags)},
    }
