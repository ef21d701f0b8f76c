"""The aiohttp application: state in a cleanup context, errors and auth in middlewares.

Shutdown order (aiohttp's runner): stop accepting -> on_shutdown (long polls return) ->
in-flight requests finish (``shutdown_timeout``) -> cleanup context exits: the store
commits what is queued and closes its index, then the executor stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..errors import MintError
from ..fleet.standby import Standby
from ..store import Store
from .auth import TokenTable
from .batching import ResolveBatcher
from .config import ServiceConfig
from .console import setup_console
from .deadlines import DEADLINE
from .errors import (
    BodyTooLarge,
    HTTPOnlyError,
    MethodNotAllowed,
    RequestTimeout,
    RouteNotFound,
    error_body,
    headers_for,
    status_for,
)
from .feed import ChangeFeed
from .hub.routes import setup_hub
from .local_copy import LOCAL_COPY, LocalCopyServer
from .maintenance import auto_maintain
from .metrics import Metrics
from .origin import check_loopback_request
from .routes.adapters import routes as adapter_routes
from .routes.blocks import routes as blocks_routes
from .routes.catalog import routes as catalog_routes
from .routes.parsing import route_label
from .routes.store_wide import PUBLIC_PATHS
from .routes.store_wide import routes as global_routes
from .rows.checks import store_blocks
from .rows.serving import RowSender
from .slots import ByteBudget, TenantSlots
from .standby import STANDBY, StandbyRole, follow_lease, refuse_as_standby
from .state import CONFIG, PRINCIPAL, STATE, ServiceState

log = logging.getLogger("mint.service")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error_response(request: web.Request, err: BaseException) -> web.Response:
    err = refuse_as_standby(request.app, err)  # a write to a standby: name the writer
    status = status_for(err, request.method)
    resp = web.json_response(error_body(err), status=status)
    if status == 401:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="mint"'
    if isinstance(err, HTTPOnlyError):
        resp.headers.update(err.headers)
    resp.headers.update(headers_for(err, request.path_qs))
    if status == 405 and "Allow" not in resp.headers:  # a read-only service: reads only
        resp.headers["Allow"] = "GET, HEAD"
    if request.body_exists and not request.content.is_eof():
        # the body was not read: do not keep this connection for another request
        resp.force_close()
    return resp


def _from_http_exception(exc: web.HTTPException) -> MintError:
    if exc.status == 404:
        return RouteNotFound("no such route; see /openapi.json")
    if exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ())))
        return MethodNotAllowed(f"method not allowed; allowed: {allowed}", headers={"Allow": allowed})
    if exc.status == 413:
        return BodyTooLarge(exc.text or "request body too large")
    err = HTTPOnlyError(exc.text or exc.reason)
    err.status = exc.status
    err.code = f"http_{exc.status}"
    return err


@web.middleware
async def service_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Metrics, auth, a deadline per request, and JSON errors: one middleware, because
    aiohttp wraps the handler once per middleware on every request."""
    st = request.app[STATE]
    route = route_label(request)
    started = time.perf_counter()
    resp: web.StreamResponse | None = None
    st.metrics.in_flight.inc()
    try:
        resp = await _handle(request, handler, st.config, st.tokens, route)
        return resp
    finally:
        st.metrics.in_flight.dec()
        st.metrics.observe(route, request.method, resp.status if resp is not None else 499,
                           time.perf_counter() - started)


async def _handle(request: web.Request, handler: Handler, config: ServiceConfig, tokens: TokenTable | None,
                  route: str) -> web.StreamResponse:
    try:
        async with asyncio.timeout(config.request_timeout) as deadline:
            request[DEADLINE] = deadline  # paused while a body arrives (deadlines.py)
            if tokens is None:
                check_loopback_request(request)
            elif route not in PUBLIC_PATHS:
                request[PRINCIPAL] = tokens.authenticate(request.headers.get("Authorization"))
            return await handler(request)
    except MintError as e:  # RequestTimeout of a stalled body included: the connection closes
        resp = _error_response(request, e)
        if isinstance(e, RequestTimeout):
            resp.force_close()
        return resp
    except TimeoutError as e:
        if deadline.expired():
            resp = _error_response(request, RequestTimeout(
                f"the request took longer than {config.request_timeout:g} s (request_timeout; "
                "the time its body took to arrive not counted)"))
            resp.force_close()
            return resp
        log.exception("timeout inside %s %s", request.method, request.path)
        return _error_response(request, e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(request, _from_http_exception(e))
    except (ConnectionError, asyncio.CancelledError):
        raise  # the client went away: nobody to answer
    except Exception as e:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(request, e)


def _state_context(config: ServiceConfig) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(app: web.Application) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        tokens = TokenTable.load(config.tokens_file) if config.tokens_file else None
        executor = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="mint-service")
        try:
            store = await loop.run_in_executor(executor, _open_store, config)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        metrics = Metrics()
        feed = ChangeFeed(loop, store.last_seq)
        store.add_commit_listener(feed.on_commit)
        store.add_batch_listener(metrics.batch_listener())
        rows = RowSender(store.storage, executor, on_bytes=lambda route, n: metrics.bytes_served.labels(route).inc(n),
                         read_timeout=config.read_timeout, buffers=_budget(config.read_memory, config),
                         blocks_of=store_blocks(store))
        store.add_rows_listener(rows.written)
        app[STATE] = ServiceState(config, store, executor, tokens, metrics, rows, feed,
                                  asyncio.Semaphore(config.upload_slots), ResolveBatcher(store, executor),
                                  tenant_slots=TenantSlots(config.tenant_uploads),
                                  decode_budget=_budget(config.upload_memory, config))
        metrics.uploads_receiving.set_function(app[STATE].tenant_slots.total_active)
        # a read-only store is written by another process: its commits are polled
        poller = None if store.writable else asyncio.create_task(_poll_commits(store, feed, executor))
        compactor = (asyncio.create_task(auto_maintain(store, config, executor))
                     if store.writable and config.auto_compact else None)
        tasks = [poller, compactor]
        if STANDBY in app:  # mint serve --standby: wait for the lease, then become this writer
            tasks.append(asyncio.create_task(_follow_lease(app, store, feed, metrics, config, executor, tasks)))
        try:
            yield
        finally:
            for task in reversed(tasks):  # the lease task first: it may start the compactor
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            feed.close()
            # the writer commits everything queued before it stops; then the index closes
            await loop.run_in_executor(executor, store.close)
            executor.shutdown(wait=True)

    return context


async def _follow_lease(app: web.Application, store: Store, feed: ChangeFeed, metrics: Metrics,
                        config: ServiceConfig, executor: ThreadPoolExecutor,
                        tasks: list[asyncio.Task[None] | None]) -> None:
    role = app[STANDBY]
    role.standby = Standby(store)
    loop = asyncio.get_running_loop()

    async def became_writer() -> None:  # what a writer's startup does, now that the store is one
        store.add_commit_listener(feed.on_commit)
        # the log tail replayed on taking over is no commit the listener saw: report the head once
        feed.advance(await loop.run_in_executor(executor, lambda: store.last_seq))
        if tasks[0] is not None:  # the replica's poll of the head: the commit listener reports it now
            tasks[0].cancel()
        store.add_batch_listener(metrics.batch_listener())
        store.add_rows_listener(app[STATE].rows.written)
        if config.auto_compact:
            tasks.append(asyncio.create_task(auto_maintain(store, config, executor)))
        if role.url is not None:
            try:
                await loop.run_in_executor(executor, store.advertise, role.url)
            except Exception:  # the next renewal carries the URL
                log.warning("could not record this server's URL in the writer lease", exc_info=True)

    await follow_lease(role, lambda fn: loop.run_in_executor(executor, fn), became_writer)


async def _poll_commits(store: Store, feed: ChangeFeed, executor: ThreadPoolExecutor,
                        interval: float = 0.2) -> None:
    loop = asyncio.get_running_loop()
    failures = 0
    while True:
        try:
            feed.advance(await loop.run_in_executor(executor, lambda: store.last_seq))
            failures = 0
        except Exception:  # one failed read must not stop the feed for good (long polls would sleep on)
            failures += 1
            log.exception("reading the commit head failed (%d in a row); retrying", failures)
        await asyncio.sleep(interval * min(2 ** failures, 50))


def _budget(capacity: int, config: ServiceConfig) -> ByteBudget:
    """A byte budget of ``capacity`` with each caller's share of it (``caller_share``)."""
    return ByteBudget(capacity, share=max(1, int(capacity * config.caller_share)))


def _open_store(config: ServiceConfig) -> Store:
    options = dict(config.store_options)
    if config.standby:  # read-only over its own index, caught up from the log first
        from ..fleet.standby import open_standby

        return open_standby(config.store, index_dir=config.index_dir,
                            storage_options=dict(config.storage_options) if config.storage_options else None,
                            **options)
    return Store.open(config.store, index_dir=config.index_dir, readonly=config.readonly,
                      storage_options=dict(config.storage_options) if config.storage_options else None, **options)


async def _wake_long_polls(app: web.Application) -> None:
    if STATE in app:
        app[STATE].feed.close()


async def _local_copy(app: web.Application) -> AsyncIterator[None]:
    """The Unix socket of same-machine row copies (``local_socket``), while the state lives."""
    st = app[STATE]
    config = st.config
    if config.local_socket is None:
        yield
        return
    server = LocalCopyServer(config.local_socket, st.store, st.rows, st.tokens, read_timeout=config.read_timeout,
                             idle_timeout=config.idle_timeout, map_bytes=config.local_map_bytes)
    server.start()
    app[LOCAL_COPY] = server
    try:
        yield
    finally:
        await asyncio.get_running_loop().run_in_executor(None, server.stop)


def create_app(config: ServiceConfig) -> web.Application:
    """The application; the store opens when the app starts and closes when it stops."""
    app = web.Application(
        middlewares=[service_middleware],
        client_max_size=config.json_limit,
    )
    app[CONFIG] = config
    if config.standby:
        app[STANDBY] = StandbyRole()
    app.cleanup_ctx.append(_state_context(config))
    app.cleanup_ctx.append(_local_copy)  # (inside the state's context: stopped before the store closes)
    app.on_shutdown.append(_wake_long_polls)
    app.add_routes(adapter_routes)
    app.add_routes(global_routes)
    app.add_routes(catalog_routes)
    app.add_routes(blocks_routes)
    setup_console(app)
    setup_hub(app)  # the Hugging Face Hub read protocol under /hf
    return app


def runner_options(config: ServiceConfig) -> dict[str, Any]:
    """Protocol limits for ``web.AppRunner`` (headers, keep-alive, shutdown)."""
    return {
        "max_line_size": config.max_line_size,
        "max_field_size": config.max_field_size,
        "max_headers": config.max_headers,
        "keepalive_timeout": config.idle_timeout,  # also bounds the wait for a request's headers
        "shutdown_timeout": config.shutdown_timeout,
        "access_log": logging.getLogger("aiohttp.access") if config.access_log else None,
    }


@dataclass(slots=True)
class RunningServer:
    """A started server (tests, tools). ``await stop()`` shuts it down gracefully."""

    runner: web.AppRunner
    url: str

    @property
    def app(self) -> web.Application:
        return self.runner.app

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_server(config: ServiceConfig) -> RunningServer:
    """Start the service on ``config.host:config.port`` (port 0: any free port)."""
    runner = web.AppRunner(create_app(config), **runner_options(config))
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, backlog=1024, reuse_address=True)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    host = f"[{host}]" if ":" in host else host
    url = f"http://{host}:{port}"
    await _advertise(runner.app, url)
    return RunningServer(runner, url)


async def _advertise(app: web.Application, url: str) -> None:
    """Record our URL in the store's writer lease: refused writers (the CLI) are sent here."""
    state = app.get(STATE)
    wildcard = {"http://0.0.0.0:", "http://[::]:"}
    for w in wildcard:  # a wildcard bind is reachable on loopback from this machine
        if url.startswith(w):
            url = "http://127.0.0.1:" + url[len(w):]
    if STANDBY in app:
        app[STANDBY].url = url  # advertised when this standby becomes the writer
    if state is None or not state.store.writable:
        return
    await state.run(state.store.advertise, url)


STOP_MARGIN_S = 120.0  # ServerThread.stop: past shutdown_timeout, for the store to close


class ServerThread:
    """The service on its own event loop in a daemon thread, for code that is not async
    (tests, notebooks, an engine process that hosts its own store). ``url``; ``stop()``."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mint-server", daemon=True)
        self.thread.start()
        try:
            # no fixed limit: opening replays the log tail, and a standby catches up first
            self.server = asyncio.run_coroutine_threadsafe(start_server(config), self.loop).result()
        except BaseException:
            self._halt()
            raise
        self.url = self.server.url

    def stop(self) -> None:
        """Shut down gracefully (in-flight requests finish, queued writes commit); idempotent.

        Waits for in-flight requests up to ``shutdown_timeout``, then for the store to close
        (its queued writes committed, the lease released). Should that outlast the margin,
        TimeoutError, and the loop keeps running: closing goes on rather than being cut.
        """
        if self.loop.is_closed():
            return
        stopping = asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop)
        stopping.result(self.config.shutdown_timeout + STOP_MARGIN_S)
        self._halt()

    def _halt(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


async def serve(config: ServiceConfig, *, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or ``stop`` is set), then shut down gracefully."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    server = await start_server(config)
    print(f"mint: serving {config.store} on {server.url}", file=sys.stderr)
    if config.tokens_file is None:
        print("mint: no token file: serving loopback only, every request acts as admin", file=sys.stderr)
    try:
        await stop.wait()
    finally:
        print("mint: shutting down (finishing in-flight requests, committing queued writes)", file=sys.stderr)
        await server.stop()


def _return_large_buffers_to_the_os() -> None:
    """Pin glibc's mmap threshold at 128 KiB (its initial value) for this process.

    glibc raises the threshold after each large free, so later large buffers (tensors and
    rows of uploads and exports) come from per-thread arenas that are never given back:
    the server's RSS would keep the sum of every executor thread's peak (measured: 4x more
    than the live memory of one-at-a-time uploads). Buffers over the pinned threshold are
    mmapped and unmapped when freed. Not glibc: nothing to do.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def run_server(config: ServiceConfig) -> int:
    """Blocking entry point of ``mint serve``. Returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _return_large_buffers_to_the_os()
    try:
        asyncio.run(serve(config))
    except (MintError, ValueError, OSError) as e:  # a bad token file, a held writer lock, a port in use
        print(f"mint: error: {e}", file=sys.stderr)
        return 1
    return 0


def serve_from_args(args: Any) -> int:
    """``mint serve`` with the CLI's parsed arguments (store, index, host, port, tokens)."""
    try:
        leases = {"lease_ttl_s": args.lease_ttl, "lease_renew_s": args.lease_renew}
        config = ServiceConfig(store=args.store, index_dir=args.index, host=args.host, port=args.port,
                               tokens_file=args.tokens, readonly=bool(getattr(args, "replica", False)),
                               standby=bool(getattr(args, "standby", False)),
                               local_socket=getattr(args, "local_socket", None),
                               store_options={k: v for k, v in leases.items() if v is not None})
    except ValueError as e:
        print(f"mint: error: {e}", file=sys.stderr)
        return 1  # every mint error exits 1; 2 is argparse's usage error
    return run_server(config)
