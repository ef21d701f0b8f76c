"""The ``mint`` command line. Its spellings are a public surface; scripts rely on them.

    mint publish DIR|hf://ORG/REPO[@REV] --name TENANT/NAME [--base B] [--tag T] [--json]
    mint ls [TENANT] [--json]
    mint show REF [--json]
    mint pull REF|hf://ORG/REPO[@REV] -o DIR   # hf://: from a Hub endpoint (--hf-endpoint, $HF_ENDPOINT)
    mint tag REF TAG
    mint rm REF
    mint serve [--host H] [--port P] [--tokens FILE] [--replica | --standby] [--lease-ttl S] [--lease-renew S]
               [--local-socket PATH]
    mint compact [--grace S] [--min-live R] [--json]
    mint fsck [--repair] [--json]            # exit 0 when clean, 3 when problems remain
    mint reindex [--json]
    mint stats [--json]
    mint sweep [--grace S] [--json]
    mint base add NAME --config DIR [--json]  # module shapes from a transformers config.json
    mint base ls [--json]

Exit codes: 0 success, 1 any error (the message is on stderr), 2 a usage error (argparse:
unknown option, missing argument), 3 ``mint fsck`` found problems.

Every command takes ``--store URL`` (a directory, ``file://`` or ``s3://``; default
``./mint-data`` or ``$MINT_STORE``), ``--index DIR`` (``$MINT_INDEX``), or ``--server URL``
(``$MINT_SERVER``, with ``--token``/``$MINT_TOKEN``) to go through a running service.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, cast

from ..errors import MintError, WriterLocked
from ..format.names import parse_ref


class Backend(Protocol):
    def publish(self, path: str, tenant: str, name: str, *, base: str | None, tag: str | None) -> dict[str, Any]: ...
    def ls(self, tenant: str | None) -> list[Any]: ...
    def show(self, ref: str) -> dict[str, Any]: ...
    def pull(self, ref: str, out: str) -> dict[str, Any]: ...
    def tag(self, ref: str, tag: str) -> dict[str, Any]: ...
    def rm(self, ref: str) -> dict[str, Any]: ...
    def register_base(self, base: str, shapes: dict[str, list[int]]) -> None: ...
    def bases(self) -> dict[str, int]: ...
    def close(self) -> None: ...


def list_adapters(source: Any, tenant: str) -> list[dict[str, Any]]:
    """Every adapter of ``tenant`` with its latest live version, from a Store or a client."""
    out = []
    after = None
    while batch := source.names(tenant, after=after, limit=1000):
        for name in batch:
            vs = [v for v in source.versions(tenant, name) if not v.deleted]
            out.append({"tenant": tenant, "name": name, "latest": vs[-1].version if vs else None,
                        "versions": len(vs)})
        after = batch[-1]
    return out


class LocalBackend:
    """Commands run against a store opened in this process."""

    def __init__(self, url: str, index_dir: str | None, *, write: bool) -> None:
        from ..store import Store

        opts: dict[str, Any] = {"index_dir": index_dir}
        if not write:  # reading must not create an empty store as a side effect
            from ..fleet.replica import require_store

            require_store(url)
        if write:
            self.store = Store.open(url, **opts)
            return
        try:  # reading never takes the writer lease: it works beside a running server
            self.store = Store.open(url, readonly=True, **opts)
        except FileNotFoundError:  # no index here yet: build it by opening as the writer
            self.store = Store.open(url, **opts)

    def publish(self, path: str, tenant: str, name: str, *, base: str | None, tag: str | None) -> dict[str, Any]:
        from ..format.adapter import UNSPECIFIED_BASE
        from ..peft.directory import load_peft_dir

        adapter = load_peft_dir(path, base=base or UNSPECIFIED_BASE)
        return self.store.publish(tenant, name, adapter, tag=tag).to_dict()

    def ls(self, tenant: str | None) -> list[Any]:
        if tenant is None:
            return self.store.tenants()
        return list_adapters(self.store, tenant)

    def show(self, ref: str) -> dict[str, Any]:
        return self.store.version(ref).to_dict()

    def pull(self, ref: str, out: str) -> dict[str, Any]:
        from ..peft.directory import save_peft_dir

        if ref.startswith("sha:"):
            save_peft_dir(self.store.load(ref), out)
            return {"content_id": ref[4:], "path": str(Path(out).resolve())}
        info = self.store.version(ref)  # once: the files written and the version reported are one
        save_peft_dir(self.store.load(info.ref), out)
        return info.to_dict() | {"path": str(Path(out).resolve())}

    def tag(self, ref: str, tag: str) -> dict[str, Any]:
        r = parse_ref(ref)
        return {"tenant": r.tenant, "name": r.name, "version": self.store.tag(ref, tag), "tag": tag}

    def rm(self, ref: str) -> dict[str, Any]:
        r = parse_ref(ref)
        return {"tenant": r.tenant, "name": r.name, "version": self.store.delete(ref), "deleted": True}

    def register_base(self, base: str, shapes: dict[str, list[int]]) -> None:
        self.store.register_base(base, shapes)

    def bases(self) -> dict[str, int]:
        return self.store.bases()

    def close(self) -> None:
        self.store.close()


def _seconds(text: str) -> float:
    """A duration: a finite number >= 0 (a negative or NaN grace would sweep what readers still use)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds >= 0")
    return v


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a share between 0 and 1")
    return v


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=os.environ.get("MINT_STORE", "./mint-data"),
                   help="store URL: directory, file:// or s3:// (default ./mint-data or $MINT_STORE)")
    p.add_argument("--index", default=os.environ.get("MINT_INDEX"),
                   help="LMDB index directory (default <store>/index for a local store)")
    p.add_argument("--server", default=os.environ.get("MINT_SERVER"),
                   help="go through a running service at this URL ($MINT_SERVER)")
    p.add_argument("--token", default=os.environ.get("MINT_TOKEN"), help="bearer token ($MINT_TOKEN)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _hf_endpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-endpoint", default=os.environ.get("HF_ENDPOINT"),
                   help="Hub endpoint of hf:// sources ($HF_ENDPOINT; default the Hugging Face Hub)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mint", description="MinT Store: LoRA adapter storage")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("publish", help="publish a PEFT adapter directory")
    p.add_argument("dir")
    p.add_argument("--name", required=True, help="TENANT/NAME")
    p.add_argument("--base", help="base model name (checked against a registered base)")
    p.add_argument("--tag", help="tag the new version")
    _hf_endpoint(p)
    _common(p)
    p = sub.add_parser("ls", help="list tenants, or the adapters of a tenant")
    p.add_argument("tenant", nargs="?")
    _common(p)
    p = sub.add_parser("show", help="metadata of a version")
    p.add_argument("ref")
    _common(p)
    p = sub.add_parser("pull", help="write a version as PEFT files")
    p.add_argument("ref")
    p.add_argument("-o", "--output", required=True, help="output directory")
    _hf_endpoint(p)
    _common(p)
    p = sub.add_parser("tag", help="point a tag at a version")
    p.add_argument("ref")
    p.add_argument("tag")
    _common(p)
    p = sub.add_parser("rm", help="delete a version")
    p.add_argument("ref")
    _common(p)
    p = sub.add_parser("compact", help="rewrite sparse and small shards (safe on a live store)")
    p.add_argument("--min-live", type=_fraction, default=0.5, help="rewrite shards whose live share is below this")
    p.add_argument("--grace", type=_seconds, default=None,
                   help="also sweep shards retired more than GRACE seconds ago (default: no sweep)")
    p.add_argument("--no-progress", action="store_true")
    _common(p)
    p = sub.add_parser("fsck", help="check every row, location, log entry and object")
    p.add_argument("--repair", action="store_true", help="quarantine damaged rows, delete orphans")
    p.add_argument("--no-progress", action="store_true")
    _common(p)
    p = sub.add_parser("reindex", help="rebuild the index from the log and the packs")
    _common(p)
    p = sub.add_parser("stats", help="adapters, versions, shards, bytes")
    _common(p)
    p = sub.add_parser("sweep", help="delete shards retired longer ago than the grace period")
    p.add_argument("--grace", type=_seconds, default=600.0, help="seconds (default 600)")
    _common(p)
    _base_parser(sub)
    p = sub.add_parser("serve", help="run the HTTP service")
    _common(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--tokens", help="token file (JSON); without it only loopback is served")
    p.add_argument("--replica", action="store_true",
                   help="serve read-only, following the store's log (writes answer 405 naming the writer)")
    p.add_argument("--standby", action="store_true",
                   help="serve reads and wait for the writer lease; take over when its holder stops renewing")
    p.add_argument("--lease-ttl", type=float, help="seconds a writer that stops renewing keeps the lease (10)")
    p.add_argument("--lease-renew", type=float, help="seconds between lease renewals (3)")
    p.add_argument("--local-socket", help="also listen on this Unix socket: clients on this machine (vLLM's plugin, "
                                          "MINT_LOCAL_SOCKET) have rows copied straight into their memory")
    return parser


def _base_parser(sub: Any) -> None:
    base = sub.add_parser("base", help="register and list base models (publish --base is checked against them)")
    bsub = base.add_subparsers(dest="base_command", required=True)
    p = bsub.add_parser("add", help="register a base's module shapes, from its transformers config.json")
    p.add_argument("base", metavar="NAME", help="the name publishes pass as --base (e.g. qwen3-4b)")
    p.add_argument("--config", required=True, metavar="DIR",
                   help="directory holding the base model's config.json (weights are not read)")
    _common(p)
    p = bsub.add_parser("ls", help="registered bases and their module counts")
    _common(p)


def _backend(args: argparse.Namespace, *, write: bool) -> Backend:
    if args.server:
        return remote_backend(args.server, token=args.token)
    try:
        return LocalBackend(args.store, args.index, write=write)
    except WriterLocked as e:
        if e.url is None:  # not a service: the message says who holds it and what to do
            raise
        # a running `mint serve` holds the store's writer lease: its URL is in the lease
        print(f"mint: {args.store} is served by {e.url}; sending this through it "
              f"(the same as `{with_server(getattr(args, 'argv', sys.argv[1:]), e.url)}`)", file=sys.stderr)
        return remote_backend(e.url, token=args.token)


# The backend that talks to a running service lives in the client package, which the core
# never imports (that would be a cycle): it plugs in through this entry-point group. A source
# checkout run without installed metadata finds it under its default name.
REMOTE_BACKEND_GROUP = "mint_store.remote_backend"
DEFAULT_REMOTE_BACKEND = "engine_client.client.cli_backend:RemoteBackend"


def remote_backend(url: str, *, token: str | None) -> Backend:
    """The backend for ``--server URL``: the ``mint_store.remote_backend`` plugin's class."""
    from importlib.metadata import entry_points

    found = sorted(entry_points(group=REMOTE_BACKEND_GROUP), key=lambda ep: ep.name)
    target = found[0].value if found else DEFAULT_REMOTE_BACKEND
    module, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise MintError(f"--server needs the service client {target!r}, which does not load ({e}); "
                        "install mint-store with its client package") from None
    return cast(Backend, factory(url, token=token))


def with_server(argv: Sequence[str], url: str) -> str:
    """The command line ``argv`` sent through the server at ``url`` (printed for the user)."""
    import shlex

    out: list[str] = []
    skip = False
    for a in argv:
        if skip or a.startswith("--server="):
            skip = False
            continue
        skip = a == "--server"
        if not skip:
            out.append(a)
    return shlex.join(["mint", *out, "--server", url])


def _print(args: argparse.Namespace, result: Any, text: str) -> None:
    print(json.dumps(result, indent=None if args.json else 2) if args.json else text)


def _run(args: argparse.Namespace) -> int:
    from ..format.names import split_full_name

    cmd = args.command
    if cmd == "serve":
        from ..service.app import serve_from_args

        return serve_from_args(args)
    from ..format.names import check_name, parse_ref
    from ..peft.hf_source import run_hf_source

    pulled = run_hf_source(args)  # hf:// sources: a pull is done; a publish's DIR is downloaded
    if pulled is not None:
        _print(args, pulled, f"wrote {pulled['path']}")
        return 0
    # bad names are refused before anything is opened or created
    if getattr(args, "ref", None) is not None:
        parse_ref(args.ref)
    if cmd == "tag":
        check_name(args.tag, "tag")
    if cmd == "publish":
        split_full_name(args.name)
    if cmd == "base":
        return _run_base(args)
    if cmd in ("compact", "fsck", "reindex", "stats", "sweep"):
        from .admin import run_admin

        return run_admin(args)
    backend = _backend(args, write=cmd in ("publish", "tag", "rm"))
    try:
        if cmd == "publish":
            tenant, name = split_full_name(args.name)
            r = backend.publish(args.dir, tenant, name, base=args.base, tag=args.tag)
            dedup = " (deduplicated)" if r["deduplicated"] else ""
            _print(args, r, f"published {tenant}/{name}@{r['version']} {r['content_id']}{dedup}")
        elif cmd == "ls":
            items = backend.ls(args.tenant)
            lines = items if args.tenant is None else [
                f"{i['tenant']}/{i['name']}  latest={i['latest']}  versions={i['versions']}" for i in items
            ]
            _print(args, items, "\n".join(str(x) for x in lines))
        elif cmd == "show":
            info = backend.show(args.ref)
            _print(args, info, "\n".join(f"{k}: {_shown(k, v)}" for k, v in info.items()))
        elif cmd == "pull":
            r = backend.pull(args.ref, args.output)
            _print(args, r, f"wrote {r['path']}")
        elif cmd == "tag":
            r = backend.tag(args.ref, args.tag)
            _print(args, r, f"{r['tenant']}/{r['name']}:{r['tag']} -> {r['version']}")
        elif cmd == "rm":
            r = backend.rm(args.ref)
            _print(args, r, f"deleted {r['tenant']}/{r['name']}@{r['version']}")
    finally:
        backend.close()
    return 0


def _run_base(args: argparse.Namespace) -> int:
    """``mint base add`` / ``mint base ls``, against a store or through --server."""
    from ..format.names import check_name

    if args.base_command == "add":
        from ..peft.bases import shapes_from_config

        check_name(args.base, "base")
        shapes = shapes_from_config(args.config)  # before the store is opened: a bad config changes nothing
    backend = _backend(args, write=args.base_command == "add")
    try:
        if args.base_command == "add":
            backend.register_base(args.base, shapes)
            r = {"base": args.base, "modules": len(shapes)}
            _print(args, r, f"registered base {args.base} ({len(shapes)} modules); "
                            f"publish with --base {args.base} to check adapters against it")
        else:
            bases = backend.bases()
            items = [{"base": k, "modules": n} for k, n in sorted(bases.items())]
            _print(args, items, "\n".join(f"{i['base']}  modules={i['modules']}" for i in items)
                   or "no bases registered (mint base add NAME --config DIR)")
    finally:
        backend.close()
    return 0


def _shown(key: str, value: Any) -> Any:
    """A field of ``mint show`` for people: times as ISO-8601 UTC (--json keeps epoch seconds)."""
    if key == "created" and isinstance(value, int | float):
        from datetime import UTC, datetime

        return datetime.fromtimestamp(value, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    return value


def _message(args: argparse.Namespace, e: BaseException) -> str:
    if getattr(e, "code", None) == "unauthorized":  # the server's words name the header; say the flag
        hint = ("the token from --token/$MINT_TOKEN was refused" if args.token else
                "this server needs a token: pass --token TOKEN or set MINT_TOKEN")
        return f"{e} ({hint})"
    return str(e)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Exit 0 on success, 1 on any error, 2 on a usage error (argparse), 3 when
    ``fsck`` finds problems."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(args)
    except (MintError, OSError, ValueError) as e:  # OSError: a path that is missing, a port in use
        print(f"mint: error: {_message(args, e)}", file=sys.stderr)
        return 1

