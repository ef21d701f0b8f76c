"""MinT ref -> a checked PEFT directory in the local cache. No vLLM here (see :mod:`.plugin`).

``MintResolver.resolve(base_model_name, lora_name)``:

1. ``lora_name`` must be a MinT ref (``tenant/name``, ``@N``, ``:tag``, ``sha:<content id>``);
   anything else is not ours: ``None``.
2. The ref is resolved to one version (content id, base, PEFT config); a tag or "latest"
   is pinned to that version number, so the bytes read next are exactly that content
   even if the tag moves meanwhile. Unknown or deleted: ``None``.
3. The adapter's base must match the served model (:mod:`.bases`), else :class:`WrongBase`.
4. Where this vLLM takes rows directly (:mod:`.direct`), steps 2 and 3 are one resolve of the
   ref on the calling thread (the content id and its layout's base:
   :meth:`MintResolver._row_target`) and the answer is the content's row path: vLLM's worker
   reads the row itself, once (the ref resolved on the service's socket on this machine where
   the loader has one, else over HTTP). Otherwise the cache is asked for that content id; on a miss
   the row is read (verified against its content id), rebuilt into tensors and exported as
   PEFT files.
5. The answer carries a ``lora_int_id`` stable per content id (:mod:`.ids`).

A store that cannot be reached or fails otherwise raises :class:`AdapterUnavailable`.
Never a wrong adapter: the directory is keyed by the content id that was verified.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mint_store.errors import DamagedAdapter, IntegrityError, InvalidName, MintError, NotFound, VersionDeleted
from mint_store.format.adapter import Adapter
from mint_store.format.names import parse_ref
from mint_store.format.wire import Forbidden

from ..client.mint_client import SyncMintClient
from .bases import base_mismatch
from .cache import AdapterCache
from .config import PluginConfig
from .errors import UnsafeCacheDir
from .ids import IdTable
from .paths import row_path

if TYPE_CHECKING:
    from .follower import TagFollower

log = logging.getLogger(__name__)

# answers that mean "no such adapter for this caller": vLLM gets None and may ask other resolvers
NOT_OURS = (InvalidName, NotFound, VersionDeleted, Forbidden)


class WrongBase(MintError, LookupError):
    """The adapter exists but belongs to another base than the model vLLM serves."""

    code = "wrong_base"


class AdapterUnavailable(MintError, RuntimeError):
    """The store could not be reached or could not deliver the adapter (the cause is chained)."""

    code = "adapter_unavailable"


@dataclass(frozen=True, slots=True)
class Resolution:
    lora_name: str  # as asked
    lora_int_id: int
    path: str  # the PEFT directory in the cache
    content_id: str
    ref: str  # the pinned ref that was read: tenant/name@N, or sha:<content id>
    base: str
    created: bool  # materialised by this call (False: a cache hit, or a row path)


@dataclass(frozen=True, slots=True)
class _Target:
    content_id: str
    base: str
    pinned: str
    peft_config: dict[str, Any] | None


class MintResolver:
    """Thread-safe and blocking; the client and the cache open on first use."""

    def __init__(self, config: PluginConfig, *, client: SyncMintClient | None = None,
                 cache: AdapterCache | None = None, logger: logging.Logger | None = None,
                 direct: bool = False, local: Any = None) -> None:
        self.config = config
        self.direct = direct  # answer row paths (the worker loads rows itself: direct.py)
        # the direct path's rows loader of this process (direct.DirectLoader): where it has the
        # service's socket on this machine, a ref is resolved there (no HTTP), as it reads rows
        self.local = local
        self.log = logger or log
        self.ids = IdTable()
        self._client = client
        self._cache = cache
        self._lock = threading.Lock()
        self._active = 0  # resolve_tracked calls in flight: releases wait for them (see release)
        self._to_release: set[str] = set()
        self._follower: TagFollower | None = None
        self._reader: Any = None  # the direct path's resolves: HttpRowReader, or the open Store
        self._bases: dict[str, str] = {}  # layout id -> base (a layout is immutable)

    def _parts(self) -> tuple[SyncMintClient, AdapterCache | None]:
        """The client, and the files cache (opened on first use: a direct resolver never does)."""
        with self._lock:
            if self._cache is None and not self.direct:
                c = self.config
                self._cache = AdapterCache(c.cache_dir, c.cache_bytes, hold=c.hold, logger=self.log)
            if self._client is None:
                c = self.config
                # a store is opened read-only: the vLLM process never takes the writer lock
                self._client = SyncMintClient(c.url, token=c.token, index_dir=c.index_dir, readonly=True)
            return self._client, self._cache

    @property
    def cache(self) -> AdapterCache | None:
        """The files cache (None for a direct resolver: rows go straight into vLLM)."""
        return self._parts()[1]

    @property
    def client(self) -> SyncMintClient:
        return self._parts()[0]

    def release(self, content_id: str) -> None:
        """The server holds no name of ``content_id`` any more: its cache entry need not be kept.

        Done once no resolution is in flight: one may have leased the entry for another name of
        the same content and not tracked it yet (released then, the entry could be evicted under
        the name it is about to be served as). Whatever a name is tracked to by then stays held."""
        with self._lock:
            self._to_release.add(content_id)
        self._release_due()

    def _release_due(self) -> None:
        # under the lock a resolution takes to count itself: none can lease an entry between the
        # look at what is held and the release (lock order: this one, then the follower's)
        with self._lock:
            if self._active or not self._to_release or self._cache is None:
                return
            held = set(self._follower.held().values()) if self._follower is not None else set()
            due, self._to_release = self._to_release - held, set()
            for cid in sorted(due):
                try:
                    self._cache.release(cid)
                except Exception as e:  # kept held (more disk, never a failed request); tried again later
                    self.log.warning("MinT: could not release %s from the adapter cache (%s: %s)", cid,
                                     type(e).__name__, e)
                    self._to_release.add(cid)

    def close(self) -> None:
        with self._lock:
            client, cache, self._client, self._cache = self._client, self._cache, None, None
            reader, self._reader = self._reader, None
        if reader is not None and hasattr(reader, "close") and self.config.is_remote:
            reader.close()  # (a Store is the client's: it closes with it)
        if client is not None:
            client.close()
        if cache is not None:
            cache.close()

    # -- the contract vLLM sees ------------------------------------------------------------

    def resolve(self, base_model_name: str, lora_name: str) -> Resolution | None:
        """None when ``lora_name`` is not a MinT adapter this caller can see; raises
        :class:`WrongBase` or :class:`AdapterUnavailable` when it is one that cannot be served."""
        try:
            got = self.lookup(base_model_name, lora_name)
        except NOT_OURS as e:
            self.log.info("MinT: no adapter %r (%s)", lora_name, e)
            return None
        except (WrongBase, AdapterUnavailable) as e:
            self.log.warning("%s", e)
            raise
        self.log.info("MinT: %r -> %s (content %s, %s)", lora_name, got.ref, got.content_id,
                      "row" if self.direct else "materialised" if got.created else "cached")
        return got

    def resolve_tracked(self, base_model_name: str, lora_name: str,
                        follower: TagFollower | None) -> Resolution | None:
        """:meth:`resolve`, then (with a follower) the name tracked and looked at once more: the
        follower sees every move after the name is tracked, but a move while it was being
        resolved came before; then it is resolved again (a few times at most)."""
        with self._lock:
            self._active += 1
            if follower is not None:
                self._follower = follower
        try:
            return self._resolve_tracked(base_model_name, lora_name, follower)
        finally:
            with self._lock:
                self._active -= 1
            self._release_due()

    def _resolve_tracked(self, base_model_name: str, lora_name: str,
                         follower: TagFollower | None) -> Resolution | None:
        got = self.resolve(base_model_name, lora_name)
        for attempt in range(4):
            if got is None or follower is None:
                return got
            follower.track(lora_name, got.content_id)  # what the server will hold: tracked, always
            if attempt == 3:
                break
            try:
                now = self.current(lora_name)
            except Exception as e:  # the store unreachable just now: serve what was resolved (tracked)
                self.log.warning("MinT: could not look at %r again after resolving it (%s: %s)", lora_name,
                                 type(e).__name__, e)
                break
            if now == got.content_id:
                break
            got = self.resolve(base_model_name, lora_name)
        return got

    def lookup(self, base_model_name: str, lora_name: str) -> Resolution:
        """Like :meth:`resolve`, raising the typed error instead of returning None."""
        ref = parse_ref(lora_name)
        try:
            client, cache = self._parts()
        except UnsafeCacheDir as e:  # (the plugin checks at start; changed since): a 503 that names the fix
            raise AdapterUnavailable(f"cannot serve MinT adapter {lora_name!r}: {e}") from e
        target = self._target(client, lora_name, str(ref))
        why = base_mismatch(target.base, base_model_name, self.config.base)
        if why is not None:
            raise WrongBase(f"MinT adapter {lora_name!r} cannot be served on {base_model_name!r}: {why}")
        if self.direct:
            return Resolution(lora_name, self.ids.id_for(target.content_id),
                              row_path(self.config.cache_dir, target.content_id), target.content_id,
                              target.pinned, target.base, False)
        assert cache is not None  # (a files resolver opens it)
        try:
            entry = cache.get(target.content_id, lambda: self._files(client, target))
        except NOT_OURS:  # e.g. deleted between the lookup and the read
            raise
        except Exception as e:
            raise AdapterUnavailable(f"cannot materialise MinT adapter {lora_name!r} ({target.pinned}) "
                                     f"from {self.config.url}: {e}") from e
        return Resolution(lora_name, self.ids.id_for(target.content_id), str(entry.path), target.content_id,
                          target.pinned, target.base, entry.created)

    def current(self, lora_name: str) -> str | None:
        """The content id ``lora_name`` resolves to now; None when it no longer resolves for
        this caller (deleted, quarantined, gone). What :class:`.follower.TagFollower` compares."""
        client, _ = self._parts()
        try:
            return client.resolve(lora_name).content_id
        except (*NOT_OURS, DamagedAdapter):
            return None

    # -- steps -----------------------------------------------------------------------------

    def _target(self, client: SyncMintClient, lora_name: str, ref: str) -> _Target:
        try:
            if self.direct:
                return self._row_target(client, ref)
            if ref.startswith("sha:"):
                loc = client.resolve(ref)
                return _Target(loc.content_id, client.layout(loc.layout_id).base, ref, None)

            # the version and where its row lies, asked at once (one round trip, not two)
            async def both() -> tuple[Any, Any]:  # (gathered on the client's loop)
                return await asyncio.gather(client.client.version(ref), client.client.resolve(ref),
                                            return_exceptions=True)

            info, at = client.call(both())
            if isinstance(info, BaseException):
                raise info
            if info.deleted:
                raise VersionDeleted(f"{info.ref} is deleted")
            # a quarantined row answers DamagedAdapter here, as for a sha: name (version() does
            # not look at the row's state; a cached copy must not outlive its quarantine). Asked
            # of the pinned version again unless ``ref`` answered with that version's own row
            # (a tag that moved between the two answers, or an error that may be another's)
            if isinstance(at, BaseException) or at.content_id != info.content_id:
                client.resolve(info.ref)
            return _Target(info.content_id, info.base, info.ref, info.peft_config)
        except NOT_OURS:
            raise
        except Exception as e:
            raise AdapterUnavailable(f"cannot look up MinT adapter {lora_name!r} at {self.config.url}: "
                                     f"{type(e).__name__}: {e}") from e

    def _row_target(self, client: SyncMintClient, ref: str) -> _Target:
        """The direct path's lookup: one resolve of ``ref``, on this thread (a store's index, or one
        request to the service). The worker reads the row by its content id, so no version record
        is asked for: a name's or tag's index entry carries its content id, a deleted version has
        none (deleting a version drops its tags), and a quarantined row is refused here as by every
        resolve. The base is its layout's (immutable, so asked once per layout)."""
        local = self.local.local_rows() if self.local is not None else None
        if local is not None:
            from ..errors import ConnectionFailed

            try:
                loc = local.resolve(ref)  # (the same answer as POST /v1/resolve; None: an older service)
            except ConnectionFailed as e:  # (HTTP for a while, as the loader's reads)
                self.local.socket_failed(local, e)
            else:
                if loc is not None:
                    return self._answer(client, loc)
        return self._answer(client, self._row_reader(client).resolve(ref))

    def _row_reader(self, client: SyncMintClient) -> Any:
        """What the direct lookup asks: an HttpRowReader of the service, or the store the client
        opened read-only (its reads are thread-safe); made once, closed with the resolver."""
        with self._lock:
            if self._client is not client:  # closed since this lookup took its client: never keep a
                # reader of a closed client for the next one (the caller reports it as unavailable)
                raise RuntimeError("the resolver was closed during this lookup; ask again")
            if self._reader is None:
                from ..client.http_rows import HttpRowReader

                c = self.config
                self._reader = HttpRowReader(c.url, c.token) if c.is_remote else client.call(_local(client).store())
            return self._reader

    def _answer(self, client: SyncMintClient, loc: Any) -> _Target:
        """The target of a resolved row: its content id and its layout's base."""
        base = self._bases.get(loc.layout_id)
        if base is None:
            base = client.layout(loc.layout_id).base
            with self._lock:
                if len(self._bases) >= 4096:
                    self._bases.pop(next(iter(self._bases)))
                self._bases[loc.layout_id] = base
        return _Target(loc.content_id, base, f"sha:{loc.content_id}", None)

    @staticmethod
    def _files(client: SyncMintClient, target: _Target) -> dict[str, bytes]:
        from mint_store.peft.adapter_config import CONFIG_NAME
        from mint_store.peft.directory import WEIGHTS_NAME, peft_files

        loc, row = client.read(target.pinned)  # verified against loc.content_id
        if loc.content_id != target.content_id:  # a version's content never changes; a bug if it did
            raise IntegrityError(f"{target.pinned} now holds {loc.content_id}, not {target.content_id}")
        layout = client.layout(loc.layout_id)
        if layout.base != target.base:
            raise IntegrityError(f"{target.pinned}: layout base {layout.base!r} != version base {target.base!r}")
        config, weights = peft_files(for_vllm(Adapter.from_row(layout, row, peft_config=target.peft_config)))
        return {CONFIG_NAME: config, WEIGHTS_NAME: weights}


def _local(client: SyncMintClient) -> Any:
    """The client of a store opened in this process (``LocalMintClient``: its ``store()``)."""
    return client.client


def for_vllm(adapter: Adapter) -> Adapter:
    """``adapter`` as vLLM applies it right: vLLM takes one scaling per adapter (``lora_alpha / r``
    of the config, or over sqrt(r) with rsLoRA) and ignores ``rank_pattern``/``alpha_pattern``,
    so an adapter whose modules scale differently (mixed ranks or alphas) ran with one module's
    scaling everywhere. Such an adapter's scalings are folded into its B factors (in float32,
    as vLLM's own ``optimize`` does) under a config where every module's scaling is 1: ``r`` the
    largest rank (what vLLM checks against ``max_lora_rank``), ``lora_alpha`` equal to it, and the
    patterns that keep the files loadable by PEFT with the same numbers. Uniform ones are as stored.
    """
    from mint_store.format.adapter import LoraModule
    from mint_store.peft.directory import synthesize_config

    mods = adapter.modules
    if _as_vllm_reads_it(adapter):
        return adapter
    r = max(m.rank for m in mods)
    folded = tuple(LoraModule(m.name, m.a, (m.b.float() * m.scaling).to(m.b.dtype), 1.0) for m in mods)
    # the synthesised config of the folded modules, with the largest rank declared (vLLM checks it
    # against max_lora_rank) and every module's alpha equal to its rank (scaling 1, for PEFT too)
    config = synthesize_config(Adapter(adapter.base, folded)) | {
        "r": r, "lora_alpha": r,
        "rank_pattern": {re.escape(m.name): m.rank for m in mods if m.rank != r},
        "alpha_pattern": {re.escape(m.name): m.rank for m in mods if m.rank != r},
    }
    return Adapter(adapter.base, folded, config)


def _as_vllm_reads_it(adapter: Adapter) -> bool:
    """Whether vLLM, reading the config :func:`~mint_store.peft.directory.peft_files` writes (the stored
    one, else the synthesised one), gives every module its own scaling and sees its largest rank."""
    from mint_store.peft.directory import synthesize_config

    config = adapter.peft_config if adapter.peft_config is not None else synthesize_config(adapter)
    try:
        r, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        return False
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return (max(m.rank for m in adapter.modules) <= r
            and all(math.isclose(m.scaling, scaling, rel_tol=2**-20) for m in adapter.modules))
