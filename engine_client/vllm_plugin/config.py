"""The plugin's settings, read from the environment of the vLLM process.

| variable | meaning | default |
| --- | --- | --- |
| ``MINT_SERVER`` | the MinT service, ``http(s)://host:port`` (wins over ``MINT_STORE``, as in the CLI) | |
| ``MINT_STORE`` | or a store opened read-only in the vLLM process: directory, ``file://``, ``s3://`` | |
| ``MINT_TOKEN`` | bearer token for ``MINT_SERVER`` | none |
| ``MINT_LOCAL_SOCKET`` | ``MINT_SERVER``'s Unix socket here (``mint serve --local-socket``): rows copied | ``auto`` |
|  | straight into the worker's memory (HTTP while it is not there). ``auto``: the socket the service | |
|  | names (``GET /v1/local-socket``), where the server answering there is that service; ``off``: none | |
| ``MINT_INDEX`` | the LMDB index of ``MINT_STORE`` (as ``mint --index``) | the store's default |
| ``MINT_VLLM_CACHE_DIR`` | where PEFT directories are materialised | ``~/.cache/mint-store/vllm`` |
| ``MINT_VLLM_CACHE_BYTES`` | size limit of that cache, in bytes | ``10737418240`` (10 GiB) |
| ``MINT_VLLM_BUFFER_BYTES`` | freed row buffers a worker keeps for later loads (:mod:`.buffers`) | 1 GiB |
| ``MINT_VLLM_CACHE_HOLD`` | ``1``: never evict what a live process returned to vLLM; ``0``: plain LRU | ``1`` |
| ``MINT_VLLM_BASE`` | the MinT base name of the model vLLM serves (see :mod:`.bases`) | derived |
| ``MINT_VLLM_FOLLOW`` | ``1``: an OpenAI server drops names whose tag moved (see :mod:`.follower`) | ``1`` |
| ``MINT_VLLM_URL`` | this vLLM server as the follower reaches it | from ``--host``/``--port`` |
| ``MINT_VLLM_LOAD`` | ``auto``: rows into vLLM if it can (:mod:`.direct`), else files; ``direct``; ``files`` | auto |
| ``MINT_VLLM_PRELOAD`` | refs an OpenAI server loads at start (comma-separated), before its first request | none |
| ``MINT_VLLM_WARM`` | ``1``: a moved tag's new content is loaded before the name switches (:mod:`.preload`) | ``1`` |

With neither ``MINT_SERVER`` nor ``MINT_STORE`` set the plugin registers nothing.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mint_store.format.names import check_name, parse_ref

DEFAULT_CACHE_BYTES = 10 << 30
DEFAULT_BUFFER_BYTES = 1 << 30
RESOLVER_NAME = "MinT Store"  # the name vLLM's LoRAResolverRegistry knows the plugin by
LOAD_MODES = ("auto", "direct", "files")
LoadMode = Literal["auto", "direct", "files"]



def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "mint-store" / "vllm"


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginConfig:
    url: str
    token: str | None = None
    local_socket: Path | None = None  # MINT_SERVER's socket on this machine (service/local_copy.py)
    find_socket: bool = True  # no local_socket: take the one MINT_SERVER names, where it is its own, here
    index_dir: str | None = None
    cache_dir: Path
    cache_bytes: int = DEFAULT_CACHE_BYTES
    buffer_bytes: int = DEFAULT_BUFFER_BYTES
    hold: bool = True
    base: str | None = None
    follow: bool = True
    server_url: str | None = None
    load: LoadMode = "auto"
    preload: tuple[str, ...] = ()
    warm: bool = True

    def __post_init__(self) -> None:
        if self.load not in LOAD_MODES:
            raise ValueError(f"MINT_VLLM_LOAD must be one of {', '.join(LOAD_MODES)}, got {self.load!r}")
        for ref in self.preload:
            try:
                parse_ref(ref)
            except ValueError as e:
                raise ValueError(f"MINT_VLLM_PRELOAD: {ref!r} is not a MinT ref ({e})") from None
        if self.local_socket is not None and not self.is_remote:
            raise ValueError("MINT_LOCAL_SOCKET is the socket of the service MINT_SERVER names; with MINT_STORE "
                             "the plugin reads the store's files itself")
        if self.cache_bytes < 0:
            raise ValueError(f"MINT_VLLM_CACHE_BYTES must be >= 0, got {self.cache_bytes}")
        if self.buffer_bytes < 0:
            raise ValueError(f"MINT_VLLM_BUFFER_BYTES must be >= 0, got {self.buffer_bytes}")
        if self.base is not None:
            check_name(self.base, "MINT_VLLM_BASE")
        if self.server_url is not None and not _http_url(self.server_url):
            raise ValueError(f"MINT_VLLM_URL must be this vLLM server's http(s):// URL, got {self.server_url!r}")
        if "://" not in self.url and _looks_like_host_port(self.url):
            raise ValueError(f"MINT_SERVER/MINT_STORE {self.url!r} looks like host:port: a service is named by its "
                             f"URL (http://{self.url}); a store opened in this process by a path or s3:// URL")

    @property
    def is_remote(self) -> bool:
        return self.url.startswith(("http://", "https://"))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginConfig | None:
        """The settings in ``env`` (default ``os.environ``); None when no store is named."""
        env = os.environ if env is None else env
        url = env.get("MINT_SERVER") or env.get("MINT_STORE")
        if not url:
            return None
        socket, find_socket = _socket(env)
        return cls(
            url=url,
            token=env.get("MINT_TOKEN") or None,
            local_socket=socket,
            find_socket=find_socket,
            index_dir=env.get("MINT_INDEX") or None,
            cache_dir=Path(env.get("MINT_VLLM_CACHE_DIR") or default_cache_dir()).expanduser(),
            cache_bytes=_int(env, "MINT_VLLM_CACHE_BYTES", DEFAULT_CACHE_BYTES),
            buffer_bytes=_int(env, "MINT_VLLM_BUFFER_BYTES", DEFAULT_BUFFER_BYTES),
            hold=_flag(env, "MINT_VLLM_CACHE_HOLD", True),
            base=env.get("MINT_VLLM_BASE") or None,
            follow=_flag(env, "MINT_VLLM_FOLLOW", True),
            server_url=env.get("MINT_VLLM_URL") or None,
            load=(env.get("MINT_VLLM_LOAD") or "auto").strip().lower(),  # type: ignore[arg-type]
            preload=tuple(r.strip() for r in (env.get("MINT_VLLM_PRELOAD") or "").split(",") if r.strip()),
            warm=_flag(env, "MINT_VLLM_WARM", True),
        )


_OFF = ("off", "0", "no", "false", "none")


def _socket(env: Mapping[str, str]) -> tuple[Path | None, bool]:
    """MINT_LOCAL_SOCKET: ``(the path it names, whether to find the service's own)``."""
    text = (env.get("MINT_LOCAL_SOCKET") or "").strip()
    if text.lower() in ("", "auto"):
        return None, True
    if text.lower() in _OFF:
        return None, False
    return Path(text).expanduser(), False


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer number of bytes, got {text!r}") from None


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0, got {text!r}")


def _http_url(text: str) -> bool:
    parts = urllib.parse.urlsplit(text)
    return parts.scheme in ("http", "https") and bool(parts.netloc)


def _looks_like_host_port(text: str) -> bool:
    """``127.0.0.1:8470``, ``localhost:8470``: a service's address without its scheme."""
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and "/" not in text)
