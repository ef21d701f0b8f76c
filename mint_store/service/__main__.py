"""``python -m mint_store.service``: the service without the CLI (tools and benchmarks use it)."""

from __future__ import annotations

import argparse
import sys

from .app import run_server
from .config import DEFAULT_PORT, ServiceConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mint_store.service", description="the MinT Store HTTP service")
    p.add_argument("--store", default="./mint-data", help="directory, file:// or s3:// URL")
    p.add_argument("--index", help="LMDB index directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--tokens", help="token file (JSON); without it only loopback is served")
    p.add_argument("--workers", type=int, default=8, help="threads for blocking store calls")
    p.add_argument("--body-limit", type=int, default=2 * 2**30, help="upload limit in bytes")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds of server work per request (the time a body takes to arrive not counted)")
    p.add_argument("--read-timeout", type=float, default=30.0, help="seconds a body (or a reader) may stall: 408")
    p.add_argument("--upload-slots", type=int, default=16, help="complete uploads decoded and committed at once")
    p.add_argument("--tenant-uploads", type=int, default=4, help="uploads of one tenant receiving at once")
    p.add_argument("--upload-memory", type=int, default=2**30, help="weights bytes decoded at once")
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--standby", action="store_true", help="wait for the writer lease; take over when it expires")
    p.add_argument("--lease-ttl", type=float, help="writer lease TTL in seconds (10)")
    p.add_argument("--lease-renew", type=float, help="writer lease renew interval in seconds (3)")
    a = p.parse_args(argv)
    leases = {"lease_ttl_s": a.lease_ttl, "lease_renew_s": a.lease_renew}
    try:
        config = ServiceConfig(store=a.store, index_dir=a.index, host=a.host, port=a.port, tokens_file=a.tokens,
                               workers=a.workers, body_limit=a.body_limit, request_timeout=a.request_timeout,
                               read_timeout=a.read_timeout, upload_slots=a.upload_slots,
                               tenant_uploads=a.tenant_uploads, upload_memory=a.upload_memory,
                               access_log=a.access_log, standby=a.standby,
                               store_options={k: v for k, v in leases.items() if v is not None})
    except ValueError as e:
        print(f"mint: error: {e}", file=sys.stderr)
        return 1  # as `mint serve`: every error exits 1, argparse's usage errors 2
    return run_server(config)


if __name__ == "__main__":
    sys.exit(main())
