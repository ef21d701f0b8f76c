"""The service's one validated configuration object."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GiB = 2**30
MiB = 2**20
DEFAULT_PORT = 8470


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceConfig:
    """Everything ``mint serve`` needs. Limits are enforced while reading, not after."""

    store: str = "./mint-data"
    index_dir: str | None = None
    storage_options: Mapping[str, Any] | None = None
    store_options: Mapping[str, Any] = field(default_factory=dict)  # more StoreConfig fields
    readonly: bool = False
    standby: bool = False  # read-only until the writer lease is free, then the writer (standby.py)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    tokens_file: str | None = None
    body_limit: int = 2 * GiB  # a whole upload
    config_limit: int = 1 * MiB  # the adapter_config.json part
    json_limit: int = 16 * MiB  # JSON request bodies (resolve, bases, tags)
    max_line_size: int = 8190  # request line
    max_field_size: int = 8190  # one header
    max_headers: int = 100
    request_timeout: float = 300.0  # one request's server work (receiving and sending bodies not counted)
    idle_timeout: float = 75.0  # keep-alive, and waiting for a request's headers
    shutdown_timeout: float = 30.0  # in-flight requests get this long to finish
    workers: int = 8  # threads for blocking store calls
    upload_slots: int = 16  # received uploads decoded and committed at once; more wait
    tenant_uploads: int = 4  # uploads of one tenant receiving their bodies at once; more of it wait
    read_timeout: float = 30.0  # per read of a body: no bytes for this long -> 408
    upload_buffer: int = 1 * MiB  # bytes of an upload held in memory before they go to its temp file
    upload_memory: int = 1 * GiB  # weights bytes decoded at once (one upload alone always is)
    read_memory: int = 1 * GiB  # row bytes held at once by multi-range answers and PEFT exports (one always is)
    # of upload_memory and read_memory, what one caller (token) may hold while another waits:
    # a tenant whose clients read (or send) slowly cannot take the whole budget from the others
    caller_share: float = 0.25
    upload_dir: str | None = None  # temp files of uploads (default: the system's)
    max_resolve: int = 10_000
    max_event_wait: float = 60.0
    access_log: bool = False
    # a Unix socket where clients on this machine have rows copied into their own memory
    # (local_copy.py: one kernel copy, no loopback stream); None: HTTP only
    local_socket: str | None = None
    # callers' row buffers it keeps mapped between copies (copy_targets.py): a kept mapping
    # holds memory the caller may have freed, so within this many bytes in all; 0: none kept
    local_map_bytes: int = 2 << 30
    # LSM-style background compaction: every interval, compact what the policy picks, and
    # sweep shards retired longer ago than the grace period
    auto_compact: bool = True
    compact_interval_s: float = 60.0
    compact_grace_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port!r} is not in 0..65535")
        for name in ("body_limit", "config_limit", "json_limit", "max_line_size", "max_field_size",
                     "max_headers", "workers", "upload_slots", "max_resolve",
                     "tenant_uploads", "upload_buffer", "upload_memory", "read_memory"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        for name in ("request_timeout", "idle_timeout", "shutdown_timeout", "max_event_wait", "compact_interval_s",
                     "read_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if isinstance(self.caller_share, bool) or not isinstance(self.caller_share, int | float) \
                or not 0 < self.caller_share <= 1:
            raise ValueError(f"caller_share must be a fraction in (0, 1], not {self.caller_share!r}")
        if self.standby and self.readonly:
            raise ValueError("a standby becomes the writer when the lease is free: drop readonly, or standby")
        if self.tokens_file is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host!r} without a token file: anyone who can reach it could "
                "read and write every adapter. Pass --tokens FILE, or bind a loopback address (127.0.0.1)"
            )
        if self.tokens_file is not None and not os.path.isfile(self.tokens_file):
            raise ValueError(f"token file {self.tokens_file!r} does not exist")
        if isinstance(self.local_map_bytes, bool) or not isinstance(self.local_map_bytes, int) \
                or self.local_map_bytes < 0:
            raise ValueError(f"local_map_bytes must be an integer >= 0, not {self.local_map_bytes!r}")
        if self.local_socket is not None and not os.path.isdir(os.path.dirname(os.path.abspath(self.local_socket))):
            raise ValueError(f"the directory of local_socket {self.local_socket!r} does not exist")
        if self.upload_dir is not None and not os.path.isdir(self.upload_dir):
            raise ValueError(f"upload directory {self.upload_dir!r} does not exist")
