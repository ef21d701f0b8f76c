"""``MultiLoRATrainer``: many LoRA policies trained at once on one frozen, resident base.

    trainer = MultiLoRATrainer(model, "/data/mint", publish_every=10)
    trainer.add_policy("acme/math", LoraSpec(r=8, target_modules=("q_proj", "v_proj")),
                       optim=OptimConfig(lr=1e-4))
    trainer.add_policy("acme/code", "acme/code@7", optim=OptimConfig(lr=5e-5))   # resume
    trainer.sft_step(ids, labels, policies=["acme/math", "acme/code", ...])       # one row each

Every sequence of a batch belongs to one policy; a batch mixing policies (and layouts)
is one forward and one backward through the engine's kernels (see :mod:`.lora_stack`).
Each policy's loss is normalised by its own token count and the batch loss is their
sum, so a policy's gradient is the gradient of its own loss alone: what training it
alone on its rows would give (the tests compare with PEFT).

Optimizer semantics (:mod:`.multi_adamw`): per-policy AdamW state, learning rate, betas,
weight decay and gradient clipping (each policy's norm over its own parameters). A
policy whose gradient is exactly zero in a step (no tokens of it in the batch, zero
advantages, all targets masked) is not stepped at all: its weights, moments and step
count stay bit-identical, where ``torch.optim.AdamW`` would move it by momentum and
weight decay.

Handoff: :meth:`publish` writes every policy to the store as a new version of its
``tenant/name`` and moves the tag (``latest`` by default), so an engine serving
``tenant/name:latest`` with ``follow=True`` swaps to it at its next batch; with
``publish_every=K`` this happens every K optimizer steps. :meth:`rollback` moves the tag
back (and, with ``restore=True``, puts those weights back into training). A policy starts
from a :class:`LoraSpec` (PEFT's init), an :class:`~mint_store.format.adapter.Adapter`, or any
stored ref (``tenant/name@N``): the resume path after a crash. Optimizer moments are not
stored; a resumed policy restarts them from zero.

Tensor-parallel base (``distributed_config=DistributedConfig(tp_size=N)`` under ``torchrun``):
the same trainer, policies and steps on every rank; each rank holds the full policies, computes on its slices, sums the
gradients before a step; only rank 0 publishes (others get ``{}``). See :mod:`.tp_train`.

The base runs as it is (eval mode: no dropout); its parameters are frozen for the
trainer's lifetime and restored by :meth:`close`.

Its options and reports are in :mod:`.trainer_types`, supervised losses in :mod:`.sft`, the
handoff (publish, rollback) in :mod:`.handoff`.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mint_store import PublishResult
from mint_store.errors import CommitConflict, MintError, StoreUnavailable, WriterFenced, WriterLocked
from mint_store.format.adapter import UNSPECIFIED_BASE, Adapter, make_adapter
from mint_store.format.names import parse_ref, split_full_name
from mint_store.format.wire import ConnectionFailed, HTTPError, RequestTimeout, ServiceUnavailable

from ..client.mint_client import SyncMintClient
from ..engine.lora_layers import BatchContext, LayoutBatch, use_batch
from ..engine.targets import check_layout
from ..errors import BatchMismatch, LayoutMismatch, PolicyExists, PolicyNotFound, TrainerError
from ..kernels.ops import progression_of
from ..tp.sharding import tp_model
from .handoff import Handoff
from .lora_stack import (
    LoraSpec,
    PolicyStack,
    Wrapping,
    adapter_factors,
    init_factors,
    resolve_targets,
    stack_key,
)
from .multi_adamw import OptimConfig, StackedAdamW
from .sft import Supervised
from .tp_train import check_trainable, sum_sharded_grads
from .trainer_types import Policy, StepReport, TrainerConfig

log = logging.getLogger(__name__)
# a handoff failing with one of these is tried again after the next step; anything else raises.
# CommitConflict and WriterFenced: the writer lease changed hands, nothing of it was committed
_PASSING = (StoreUnavailable, ServiceUnavailable, ConnectionFailed, RequestTimeout, WriterLocked, CommitConflict,
            WriterFenced)


def _passing(e: MintError) -> bool:
    """An outage the next step may not meet: the store or the service briefly away."""
    return isinstance(e, _PASSING) or (isinstance(e, HTTPError) and getattr(e, "status", 0) in (502, 503, 504))

_STACK_IDS = itertools.count()  # policy stack ids, process-wide


class MultiLoRATrainer(Handoff, Supervised):
    """Trains N LoRA policies of any layouts on ``model`` (frozen); publishes them via ``client``.

    Parameters
    ----------
    model
        A transformers model; its parameters are frozen until :meth:`close`.
    client
        A :class:`SyncMintClient`, a store URL or directory (a client is opened and owned),
        or None (no store: no policies from refs, no publish).
    base
        The MinT base name stamped on published policies (default ``unspecified``).
    publish_every
        Publish every policy after every K-th :meth:`step` (None: only on :meth:`publish`).
    tag
        The tag each publish moves (None: publish only).
    dtype
        Master weights of every policy (and the published tensors).
    client_options
        :class:`ClientConfig` fields for a client opened from a URL.

    Raises
    ------
    ValueError
        An option out of range (``publish_every`` < 1, a non-float ``dtype``).
    InvalidName
        A bad ``base`` or ``tag``.
    """

    def __init__(
        self,
        model: nn.Module,
        client: SyncMintClient | str | os.PathLike[str] | None = None,
        *,
        base: str = UNSPECIFIED_BASE,
        publish_every: int | None = None,
        tag: str | None = "latest",
        dtype: torch.dtype = torch.float32,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        self._tp = tp_model(model)  # a base loaded with tp_plan (module docstring); raises before any change
        self.config = TrainerConfig(base=base, publish_every=publish_every, tag=tag, dtype=dtype)
        self.model = model
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self._owns_client = not isinstance(client, SyncMintClient | None)
        self.client: SyncMintClient | None = (
            client if isinstance(client, SyncMintClient | None) else SyncMintClient(client, **(client_options or {}))
        )
        # the base is frozen: only the policies' stacks get gradients
        self._frozen = [(p, p.requires_grad) for p in model.parameters()]
        for p, _ in self._frozen:
            p.requires_grad_(False)
        self._wrap = Wrapping(model, self._tp)
        self._stacks: list[PolicyStack] = []
        self._optim: dict[str, StackedAdamW] = {}  # stack id -> its optimizer state
        self._policies: dict[str, Policy] = {}
        self.steps = 0
        self._publish_pending = False  # a handoff failed: tried again after the next step
        self._closed = False

    # -- policies -----------------------------------------------------------------------------

    def add_policy(
        self, name: str, init: LoraSpec | Adapter | str | None = None, *, optim: OptimConfig | None = None
    ) -> Policy:
        """Add policy ``name`` (``tenant/name``) from scratch (:class:`LoraSpec`), an Adapter, or a ref.

        Policies of the same layout share one stack, which grows by a copy: add policies
        between steps (gradients accumulated but not yet stepped are dropped).

        Parameters
        ----------
        name
            ``tenant/name``: where the policy is published.
        init
            A :class:`LoraSpec` (new factors; None: the default spec), an
            :class:`~mint_store.format.adapter.Adapter`, or a ref to load from the store.
        optim
            Its optimizer settings (default :class:`OptimConfig`).

        Returns
        -------
        Policy
            What the trainer holds of it.

        Raises
        ------
        PolicyExists
            The trainer already holds ``name``.
        LayoutMismatch
            The adapter does not fit the model.
        InvalidName, NotFound
            A bad name, a ref that names nothing.
        """
        self._check_open()
        split_full_name(name)
        if name in self._policies:
            raise PolicyExists(f"the trainer already holds a policy {name!r}")
        spec = LoraSpec() if init is None else init
        source: str | None = None
        base = self.config.base
        peft_config: dict[str, Any] | None = None
        versions: list[int] = []
        if isinstance(spec, LoraSpec):
            factors = init_factors(spec, resolve_targets(spec, self.model, self._wrap.targets))
        else:
            adapter, source, version = self._load(spec)
            check_layout(adapter.layout, self._wrap.targets, what=f"adapter {source or 'given'} for policy {name!r}")
            base = self._base_of(adapter, source, name)
            factors = adapter_factors(adapter, self._wrap.targets)
            peft_config = adapter.peft_config
            if version is not None and source is not None and _full_name(source) == name:
                versions.append(version)
        if self._tp is not None:  # before anything changes
            check_trainable(self._tp, [self._wrap.targets[n] for n in factors])
        key = stack_key(factors, self.config.dtype)
        stack = next((s for s in self._stacks if s.key == key), None)
        # all or nothing: a failure (out of memory growing the stack or its moments) leaves the
        # trainer as it was, every policy applied and stepped
        new = stack is None
        if stack is None:
            # ids unique in the process: one of an unclosed trainer's (still hooked to the model)
            # taken again by a later trainer at the same address applied both
            stack = PolicyStack(f"policies-{next(_STACK_IDS)}", key, self._wrap.targets, self.device)
            moments = StackedAdamW()
        else:
            moments = self._optim[stack.stack_id]
            self._wrap.detach(stack.stack_id)  # the stack's parameters are replaced by a grown copy
        saved = stack.saved()
        try:
            slot = stack.append(name, factors)
            moments.resize(list(stack.parameters()))
        except BaseException:
            stack.restore(saved)
            raise
        finally:
            if not new:  # grown, or as it was: its policies stay applied either way
                self._wrap.attach(stack)
        if new:  # registered only once it holds the policy
            self._stacks.append(stack)
            self._optim[stack.stack_id] = moments
            self._wrap.attach(stack)
        pol = Policy(name, stack, slot, optim or OptimConfig(), source, peft_config, versions, base=base)
        self._policies[name] = pol
        return pol

    def _base_of(self, adapter: Adapter, source: str | None, name: str) -> str:
        """The base a policy from ``adapter`` publishes under: the trainer's, when it declares one
        (an adapter of another declared base is refused, as an engine of that base would), else the
        adapter's own (stamped ``unspecified``, a policy resumed from a based version lost its base
        at its first publish, and the vLLM plugin refused it from then on)."""
        if self.config.base == UNSPECIFIED_BASE:
            return adapter.base
        if adapter.base not in (UNSPECIFIED_BASE, self.config.base):
            raise LayoutMismatch(f"adapter {source or 'given'} for policy {name!r} was published for base "
                                 f"{adapter.base!r}, and this trainer trains base {self.config.base!r}")
        return self.config.base

    def _load(self, init: Adapter | str) -> tuple[Adapter, str | None, int | None]:
        if isinstance(init, Adapter):
            return init, None, None
        if not isinstance(init, str):
            raise TypeError(f"init is a LoraSpec, an Adapter or a ref, got {type(init).__name__}")
        client = self._need_client("load a policy from a ref")
        ref = parse_ref(init)
        if ref.content_id is not None:
            return client.load(init), init, None
        # pin the version first: a tag or "latest" may move between two calls
        version = client.version(init).version
        return client.load(f"{ref.tenant}/{ref.name}@{version}"), init, version

    @property
    def policies(self) -> list[str]:
        return list(self._policies)

    def policy(self, name: str) -> Policy:
        pol = self._policies.get(name)
        if pol is None:
            raise PolicyNotFound(f"no policy {name!r} in this trainer (it holds {sorted(self._policies)})")
        return pol

    def set_optim(self, name: str, optim: OptimConfig) -> None:
        """Change one policy's optimizer settings (its moments are kept)."""
        self.policy(name).optim = optim

    def load_weights(self, name: str, source: Adapter | str) -> None:
        """Replace a policy's weights with an adapter or a stored ref of the same layout; resets its
        moments. Its PEFT config and source become the new adapter's: the next publish must not
        pair these scalings with the old config's alpha."""
        pol = self.policy(name)
        adapter, ref, _ = self._load(source)
        base = self._base_of(adapter, ref, name)
        factors = adapter_factors(adapter, self._wrap.targets)
        if stack_key(factors, self.config.dtype) != pol.stack.key:
            raise LayoutMismatch(f"{ref or 'the adapter'} does not have the layout of policy {name!r}")
        pol.stack.assign(pol.slot, factors)
        pol.peft_config, pol.source, pol.base = adapter.peft_config, ref, base
        self._optim[pol.stack.stack_id].reset(pol.slot)

    def adapter(self, name: str) -> Adapter:
        """Policy ``name`` as an Adapter: exact copies of its current weights (what :meth:`publish` writes)."""
        pol = self.policy(name)
        exported = pol.stack.export(pol.slot, pol.base, pol.peft_config)
        return make_adapter(exported.modules, base=pol.base, peft_config=pol.peft_config)

    def gradients(self, name: str) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Module -> (grad of A, grad of B) of one policy, in the store's shapes (copies)."""
        pol = self.policy(name)
        out: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for n in pol.stack.modules:
            pair = []
            for p in (pol.stack.a[n], pol.stack.b[n]):
                g = None if p.grad is None else p.grad[pol.slot].detach().clone()
                if g is not None and pol.stack.targets[n].kind == "linear_param":
                    g = g.unsqueeze(0)
                pair.append(g)
            out[n] = (pair[0], pair[1])
        return out

    # -- batches --------------------------------------------------------------------------------

    @contextmanager
    def batch(self, policies: Sequence[str | None]) -> Iterator[BatchContext]:
        """Route sequence ``i`` of the model calls inside the block to ``policies[i]`` (None: base)."""
        self._check_open()
        with use_batch(self._context(policies)) as ctx:
            yield ctx

    def _context(self, policies: Sequence[str | None]) -> BatchContext:
        n = len(policies)
        seqs: dict[str, list[int]] = {}
        for i, name in enumerate(policies):
            if name is None:
                continue
            pol = self.policy(name)
            seqs.setdefault(pol.stack.stack_id, [-1] * n)[i] = pol.slot
        layouts = {}
        for sid, seq in seqs.items():
            active = [i for i, s in enumerate(seq) if s >= 0]
            buf = torch.tensor(seq + active + [seq[i] for i in active], dtype=torch.int64, device=self.device)
            a = len(active)
            layouts[sid] = LayoutBatch(buf[:n], buf[n : n + a], buf[n + a :], a,
                                       progression_of([seq[i] for i in active]))
        return BatchContext(n, layouts)

    def forward(self, input_ids: torch.Tensor, policies: Sequence[str | None], **model_kwargs: Any) -> Any:
        """``model(input_ids, **model_kwargs)`` with row ``i`` on ``policies[i]``; differentiable in the policies."""
        _check_rows(input_ids, policies)
        with self.batch(policies):
            return self.model(input_ids=input_ids, **model_kwargs)

    def generate(self, input_ids: torch.Tensor, policies: Sequence[str | None], **generate_kwargs: Any) -> Any:
        """``model.generate`` with row ``i`` sampled from ``policies[i]`` (no gradients)."""
        _check_rows(input_ids, policies)
        gen: Any = self.model.generate
        with torch.no_grad(), self.batch(policies):
            return gen(input_ids=input_ids, **generate_kwargs)

    # -- optimisation ---------------------------------------------------------------------------

    def zero_grad(self) -> None:
        for s in self._stacks:
            for _, p in s.parameters():
                p.grad = None

    def step(self, policies: Iterable[str] | None = None) -> StepReport:
        """One optimizer step of ``policies`` (default: all) from the gradients accumulated so far.

        A policy whose gradient is exactly zero, or not finite, is skipped (see the module
        docstring). Gradients are cleared afterwards; a due handoff publishes every policy.

        Returns
        -------
        StepReport
            The step count, the policies stepped, their gradient norms, what was published.

        Raises
        ------
        PolicyNotFound
            A name the trainer does not hold.
        """
        self._check_open()
        wanted = set(self._policies) if policies is None else {self.policy(p).name for p in policies}
        stepped: list[str] = []
        norms_out: dict[str, float] = {}
        for s in self._stacks:
            params = list(s.parameters())
            if self._tp is not None:  # each rank's partial and slice gradients -> the full ones
                sum_sharded_grads(params, s.targets, self._tp)
            opt = self._optim[s.stack_id]
            norms = opt.grad_norms(params)  # [N]
            host = norms.tolist()
            active = []
            for slot, name in enumerate(s.names):
                go = name in wanted and host[slot] > 0.0 and math.isfinite(host[slot])
                active.append(go)
                if name in wanted:
                    norms_out[name] = host[slot]
                if go:
                    stepped.append(name)
                    self._policies[name].steps += 1
            opt.step(params, [self._policies[n].optim for n in s.names], active, norms)
        self.zero_grad()
        self.steps += 1
        published: dict[str, PublishResult] = {}
        error = None
        due = self.config.publish_every is not None and self.steps % self.config.publish_every == 0
        if due or self._publish_pending:
            # the step is taken: a store that fails the handoff must not lose its report (nor the
            # rest of a GRPO update); the handoff is tried again at the next step
            try:
                published = self.publish()
                self._publish_pending = False
            except MintError as e:
                if not _passing(e):  # a configuration error (no client, a refused token) still raises
                    raise
                self._publish_pending = True
                error = f"{type(e).__name__}: {e}"
                log.warning("publishing after step %d failed (%s); trying again after the next step",
                            self.steps, error)
        return StepReport(self.steps, tuple(stepped), norms_out, published, error)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Unhook the policies, unfreeze the base as it was, close an owned client."""
        if self._closed:
            return
        self._closed = True
        self._wrap.close([s.stack_id for s in self._stacks])
        for p, flag in self._frozen:
            p.requires_grad_(flag)
        if self._owns_client and self.client is not None:
            self.client.close()

    def __enter__(self) -> MultiLoRATrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TrainerError("the trainer is closed")

    def _need_client(self, what: str) -> SyncMintClient:
        if self.client is None:
            raise TrainerError(f"this trainer has no store client; give one to {what}")
        return self.client


def _check_rows(input_ids: torch.Tensor, policies: Sequence[str | None]) -> None:
    if input_ids.dim() < 1 or input_ids.shape[0] != len(policies):
        raise BatchMismatch(f"{len(policies)} policies for {input_ids.shape[0] if input_ids.dim() else 0} rows; give "
                            "one per row (None for the base)")


def _full_name(ref: str) -> str:
    r = parse_ref(ref)
    return f"{r.tenant}/{r.name}"
