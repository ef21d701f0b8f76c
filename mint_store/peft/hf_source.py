"""``hf://org/repo[@revision]`` sources of ``mint pull`` and ``mint publish``.

The adapter comes from any Hugging Face Hub endpoint (the Hub itself, or another MinT
service's ``/hf``) through ``huggingface_hub.snapshot_download``, with its cache: a second
pull of the same commit downloads nothing. The endpoint is ``--hf-endpoint`` or
``$HF_ENDPOINT``; the token is huggingface_hub's own (``$HF_TOKEN`` or ``hf auth login``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AdapterNotFound, InvalidName, RemoteSourceError, VersionNotFound

SCHEME = "hf://"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def is_hf_source(text: str) -> bool:
    return text.startswith(SCHEME)


@dataclass(frozen=True, slots=True)
class HfSource:
    repo_id: str
    revision: str | None

    def __str__(self) -> str:
        return SCHEME + self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hf_source(text: str) -> HfSource:
    """``hf://org/repo`` or ``hf://org/repo@revision`` (a branch, tag, commit, or MinT ``v7``)."""
    if not is_hf_source(text):
        raise InvalidName(f"{text!r} is not an hf:// source")
    repo, sep, revision = text[len(SCHEME):].partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or (sep and not revision):
        raise InvalidName(f"invalid source {text!r}: expected hf://ORG/REPO or hf://ORG/REPO@REVISION")
    return HfSource(repo, revision or None)


def download(source: str | HfSource, *, endpoint: str | None = None, cache_dir: str | None = None) -> Path:
    """The local snapshot directory of the adapter's two PEFT files (from the cache when it has them)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    src = source if isinstance(source, HfSource) else parse_hf_source(source)
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    where = f"{src} at {endpoint or 'the Hugging Face Hub'}"
    try:
        path = Path(snapshot_download(repo_id=src.repo_id, revision=src.revision, endpoint=endpoint,
                                      cache_dir=cache_dir, allow_patterns=list(ADAPTER_FILES)))
    except RepositoryNotFoundError:
        raise AdapterNotFound(f"no repo {where} (or the token, $HF_TOKEN, may not read it)") from None
    except RevisionNotFoundError:
        raise VersionNotFound(f"no such revision: {where}") from None
    except (EntryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, ValueError, OSError) as e:
        raise RemoteSourceError(f"cannot download {where}: {e}") from None
    missing = [n for n in ADAPTER_FILES if not (path / n).is_file()]
    if missing:
        raise RemoteSourceError(f"{where} is not a PEFT LoRA adapter: it has no {', '.join(missing)}")
    return path


def pull(source: str, out: str, *, endpoint: str | None = None) -> dict[str, Any]:
    """``mint pull hf://...``: check the files are a LoRA MinT can store, then copy them, unchanged."""
    from .directory import load_peft_dir

    src = parse_hf_source(source)
    snap = download(src, endpoint=endpoint)
    adapter = load_peft_dir(snap)  # refuses what `mint publish` would refuse, before writing anything
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    for name in ADAPTER_FILES:
        tmp = d / f".{name}.tmp"
        shutil.copyfile(snap / name, tmp)
        os.replace(tmp, d / name)  # a reader never sees half a file
    return {"source": str(src), "commit": snap.name, "content_id": adapter.content_id(),
            "path": str(d.resolve())}


def run_hf_source(args: Any) -> dict[str, Any] | None:
    """The CLI's hf:// handling. ``mint pull hf://...``: pulls and returns the result (no store
    is involved). ``mint publish hf://... --name T/N``: downloads, then points ``args.dir`` at
    the snapshot for the usual publish (None). Other commands and sources: None, untouched."""
    from ..format.names import split_full_name

    if args.command == "pull" and is_hf_source(args.ref):
        return pull(args.ref, args.output, endpoint=args.hf_endpoint)
    if args.command == "publish" and is_hf_source(args.dir):
        split_full_name(args.name)  # a bad name is refused before anything is downloaded
        args.dir = str(download(args.dir, endpoint=args.hf_endpoint))
    return None
