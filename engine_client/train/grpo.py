"""GRPO for many policies at once: one mixed-batch rollout, one mixed-batch update per step.

    grpo = GRPO(trainer, reward_fn, GRPOConfig(group_size=8, max_new_tokens=64, kl_coef=0.04))
    report = grpo.step({"acme/math": math_prompts, "acme/code": code_prompts})
    report.stats["acme/math"].reward_mean

One step, for every policy ``p`` and each of its prompts:

1. rollout: ``G`` completions per prompt sampled from ``p`` (temperature, no top-k/top-p
   truncation by default, seeded: ``seed`` + rollouts so far) in ONE ``generate`` call over the rows
   of every policy (each row routed to its policy's LoRA);
2. reward: ``reward_fn(policy, prompt_ids, completion_ids) -> float`` per completion;
3. advantage: within each group of ``G``, ``A = (r - mean) / (std + 1e-4)``
   (``scale_rewards=False``: ``r - mean``); population std;
4. update, ``updates_per_rollout`` times: per completion token
   ``ratio = exp(logp - logp_old)`` (``logp`` of the tempered policy, ``logits / T``),
   ``l = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A) + kl_coef * KL``
   with ``KL = exp(ref - logp) - (ref - logp) - 1`` (the k3 estimator) against the base
   with the adapter off (one no-grad pass without any LoRA, once per rollout); each
   policy's loss is the mean over its completion tokens, the batch loss their sum; then
   one optimizer step (per-policy AdamW and clipping, :mod:`.multi_adamw`).

``logp_old`` are the rollout policy's log-probs: on the first update they equal ``logp``
(detached, from the same forward: exactly a separate no-grad pass, one pass cheaper), and
later updates reuse them. A group whose rewards are all equal has zero advantages: with no
KL term its policy gets an exactly zero gradient and is not stepped (:mod:`.trainer`).
Completions end after the first EOS (``model.generation_config.eos_token_id``); tokens
after it carry no loss. Prompts of different lengths are left-padded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .trainer import MultiLoRATrainer, StepReport

RewardFn = Callable[[str, list[int], list[int]], float]  # (policy, prompt ids, completion ids) -> reward


@dataclass(frozen=True, slots=True, kw_only=True)
class GRPOConfig:
    group_size: int = 8  # G completions per prompt
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0  # 0: no truncation (the loss assumes samples come from the tempered policy)
    top_p: float = 1.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # upper clip (DAPO's clip-higher); None: clip_eps
    kl_coef: float = 0.0  # 0: no KL term and no reference pass
    updates_per_rollout: int = 1
    scale_rewards: bool = True
    micro_batch: int | None = None  # rows per forward/backward (gradients accumulate); None: all
    seed: int = 0
    pad_token_id: int | None = None  # None: the generation config's pad, else its eos, else 0

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2 (advantages are relative within a group)")
        if self.max_new_tokens < 1 or self.updates_per_rollout < 1:
            raise ValueError("max_new_tokens and updates_per_rollout must be >= 1")
        if not self.temperature > 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature must be > 0, top_p in (0, 1], top_k >= 0")
        if not self.clip_eps > 0 or (self.clip_eps_high is not None and not self.clip_eps_high > 0):
            raise ValueError("clip_eps (and clip_eps_high) must be > 0")
        if self.kl_coef < 0:
            raise ValueError("kl_coef must be >= 0")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError("micro_batch must be >= 1 (or None)")


@dataclass(frozen=True, slots=True)
class Rollout:
    """The completions of one step. ``R`` rows = sum over policies of prompts x G."""

    policies: list[str]  # [R] policy of each row
    groups: list[int]  # [R] group id (one per (policy, prompt))
    input_ids: torch.Tensor  # [R, P + L] left-padded prompt, then the completion
    attention_mask: torch.Tensor  # [R, P + L] 0 on left padding and after the completion's end
    completion_mask: torch.Tensor  # [R, L] float, 1 on the completion's tokens (EOS included)
    rewards: torch.Tensor  # [R] float32
    advantages: torch.Tensor  # [R] float32

    @property
    def prompt_len(self) -> int:
        return int(self.input_ids.shape[1] - self.completion_mask.shape[1])


@dataclass(frozen=True, slots=True)
class UpdatePlan:
    """How one rollout is trained on (see :meth:`GRPO.plan`)."""

    chunks: list[slice]  # micro-batches of rows
    tokens: dict[str, float]  # completion tokens per policy
    weight: torch.Tensor  # [R] 1 / tokens of the row's policy
    ref: list[torch.Tensor]  # per chunk [r, L] base log-probs (empty without the KL term)
    old: list[torch.Tensor]  # per chunk [r, L] rollout-policy log-probs, filled by the first pass


@dataclass(frozen=True, slots=True)
class PolicyStats:
    reward_mean: float
    reward_std: float
    loss: float  # of the last update
    kl: float  # mean KL to the base over its tokens (0 without kl_coef)
    clip_fraction: float  # tokens whose ratio was clipped, last update
    tokens: int  # completion tokens


@dataclass(frozen=True, slots=True)
class GRPOReport:
    stats: dict[str, PolicyStats]
    steps: list[StepReport]  # one per update


class GRPO:
    """GRPO steps of every policy of ``trainer`` (or the ones a step's prompts name)."""

    def __init__(self, trainer: MultiLoRATrainer, reward_fn: RewardFn, config: GRPOConfig | None = None) -> None:
        self.trainer = trainer
        self.reward_fn = reward_fn
        self.config = config or GRPOConfig()
        self.rollouts = 0
        self._keep = "logits_to_keep" in inspect.signature(trainer.model.forward).parameters

    # -- rollout --------------------------------------------------------------------------------

    def _special(self) -> tuple[set[int], int]:
        gc: Any = getattr(self.trainer.model, "generation_config", None)
        eos = getattr(gc, "eos_token_id", None)
        eos_set = set() if eos is None else {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
        pad = self.config.pad_token_id
        if pad is None:
            pad = getattr(gc, "pad_token_id", None)
        if pad is None:
            pad = min(eos_set) if eos_set else 0
        return eos_set, int(pad)

    def rollout(self, prompts: Mapping[str, Sequence[Sequence[int]]]) -> Rollout:
        """Sample, score and normalise: ``prompts`` maps policy -> its prompts (token id lists)."""
        c = self.config
        eos, pad = self._special()
        rows_prompt: list[list[int]] = []
        policies: list[str] = []
        groups: list[int] = []
        gid = -1
        for name, plist in prompts.items():
            self.trainer.policy(name)
            for p in plist:
                ids = [int(t) for t in p]
                if not ids:
                    raise ValueError(f"an empty prompt for policy {name!r}")
                gid += 1
                for _ in range(c.group_size):
                    rows_prompt.append(ids)
                    policies.append(name)
                    groups.append(gid)
        if not rows_prompt:
            raise ValueError("no prompts")
        dev = self.trainer.device
        plen = max(len(p) for p in rows_prompt)
        prompt = torch.full((len(rows_prompt), plen), pad, dtype=torch.long)
        pmask = torch.zeros_like(prompt)
        for i, p in enumerate(rows_prompt):  # left padding: every prompt ends where generation starts
            prompt[i, plen - len(p) :] = torch.tensor(p)
            pmask[i, plen - len(p) :] = 1
        prompt, pmask = prompt.to(dev), pmask.to(dev)
        fork = [dev] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=fork), _plain_sampling(self.trainer.model):
            torch.manual_seed(c.seed + self.rollouts)  # seeded without disturbing the caller's RNG
            out = self.trainer.generate(
                prompt, policies, attention_mask=pmask, do_sample=True, temperature=c.temperature,
                top_k=c.top_k, top_p=c.top_p, max_new_tokens=c.max_new_tokens, pad_token_id=pad,
                eos_token_id=sorted(eos) if eos else None,
            )
        self.rollouts += 1
        completion = out[:, plen:]  # [R, L]
        cmask = _completion_mask(completion, eos)  # [R, L]
        rewards = torch.tensor(
            [float(self.reward_fn(pol, p, completion[i][cmask[i] > 0].tolist()))
             for i, (pol, p) in enumerate(zip(policies, rows_prompt, strict=True))],
            dtype=torch.float32,
        )
        adv = _group_advantages(rewards, torch.tensor(groups), scale=c.scale_rewards)
        return Rollout(policies, groups, out, torch.cat([pmask, cmask.to(pmask.dtype)], 1), cmask.float(),
                       rewards, adv)

    # -- update ---------------------------------------------------------------------------------

    def _logprobs(self, rollout: Rollout, rows: slice, policies: Sequence[str | None]) -> torch.Tensor:
        """``[r, L]`` log-probs of the completion tokens (tempered) for ``rows`` under ``policies``."""
        ids = rollout.input_ids[rows]
        mask = rollout.attention_mask[rows]
        length = rollout.completion_mask.shape[1]
        # positions as generate computed them under left padding
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": pos}
        if self._keep:
            kwargs["logits_to_keep"] = length + 1
        if any(p is not None for p in policies):
            logits = self.trainer.forward(ids, policies, **kwargs).logits
        else:
            logits = self.trainer.model(input_ids=ids, **kwargs).logits  # the base: no LoRA context
        logits = logits[:, -(length + 1) : -1].float() / self.config.temperature  # [r, L, V]
        target = ids[:, -length:]  # [r, L]
        return torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)

    def plan(self, rollout: Rollout) -> UpdatePlan:
        """Split ``rollout`` into micro-batches; the base's log-probs once when the KL term is on."""
        c = self.config
        n = len(rollout.policies)
        mb = c.micro_batch or n
        chunks = [slice(i, min(i + mb, n)) for i in range(0, n, mb)]
        tokens: dict[str, float] = {}
        for p, t in zip(rollout.policies, rollout.completion_mask.sum(1).tolist(), strict=True):
            tokens[p] = tokens.get(p, 0.0) + t
        # [R] 1 / completion tokens of the row's policy: each policy's loss is its token mean
        weight = torch.tensor([1.0 / tokens[p] if tokens[p] else 0.0 for p in rollout.policies],
                              device=self.trainer.device)
        ref: list[torch.Tensor] = []
        if c.kl_coef:
            with torch.no_grad():
                ref = [self._logprobs(rollout, s, [None] * (s.stop - s.start)) for s in chunks]
        return UpdatePlan(chunks, tokens, weight, ref, [])

    def backward(self, rollout: Rollout, plan: UpdatePlan) -> dict[str, tuple[float, float, float]]:
        """One pass of the clipped objective over every micro-batch; gradients accumulate.

        The first pass records the old log-probs. Returns per policy (loss, kl, clip fraction).
        """
        c = self.config
        dev = self.trainer.device
        hi = c.clip_eps if c.clip_eps_high is None else c.clip_eps_high
        first = not plan.old
        sums: dict[str, list[float]] = {p: [0.0, 0.0, 0.0] for p in plan.tokens}  # loss, kl, clipped
        for k, s in enumerate(plan.chunks):
            pols = rollout.policies[s]
            logp = self._logprobs(rollout, s, pols)  # [r, L]
            if first:
                plan.old.append(logp.detach())
            m = rollout.completion_mask[s].to(dev)  # [r, L]
            live = m > 0  # tokens past an EOS carry no loss: their log-ratios are not exponentiated,
            # where one of them could overflow (0 * inf = NaN would void the policy's whole step)
            adv = rollout.advantages[s].to(dev).unsqueeze(1)  # [r, 1]
            ratio = torch.exp(torch.where(live, logp - plan.old[k], 0.0))
            clipped = torch.clamp(ratio, 1 - c.clip_eps, 1 + hi)
            per_tok = -torch.min(ratio * adv, clipped * adv)  # [r, L]
            kl = torch.zeros_like(per_tok)
            if c.kl_coef:
                d = torch.where(live, plan.ref[k] - logp, 0.0)
                kl = torch.exp(d) - d - 1
                per_tok = per_tok + c.kl_coef * kl
            w = m * plan.weight[s].unsqueeze(1)  # [r, L]
            loss = (per_tok * w).sum()
            loss.backward()
            with torch.no_grad():
                rows = torch.stack([(per_tok * w).sum(1), (kl * w).sum(1), ((ratio != clipped).float() * w).sum(1)], 1)
            for p, vals in zip(pols, rows.tolist(), strict=True):
                acc = sums[p]
                for j in range(3):
                    acc[j] += vals[j]
        return {p: (v[0], v[1], v[2]) for p, v in sums.items()}

    def update(self, rollout: Rollout) -> tuple[dict[str, tuple[float, float, float]], list[StepReport]]:
        """``updates_per_rollout`` optimizer steps on ``rollout``; per policy (loss, kl, clip fraction)."""
        plan = self.plan(rollout)
        stats: dict[str, tuple[float, float, float]] = {}
        reports = []
        for _ in range(self.config.updates_per_rollout):
            self.trainer.zero_grad()
            stats = self.backward(rollout, plan)
            reports.append(self.trainer.step(set(plan.tokens)))
        return stats, reports

    def step(self, prompts: Mapping[str, Sequence[Sequence[int]]]) -> GRPOReport:
        """Rollout and update for every policy named in ``prompts``."""
        rollout = self.rollout(prompts)
        per, reports = self.update(rollout)
        stats = {}
        for name in prompts:
            rows = torch.tensor([p == name for p in rollout.policies])
            r = rollout.rewards[rows]
            loss, kl, clip = per.get(name, (0.0, 0.0, 0.0))
            toks = int(rollout.completion_mask[rows].sum().item())
            stats[name] = PolicyStats(float(r.mean()), float(r.std(unbiased=False)), loss, kl, clip, toks)
        return GRPOReport(stats, reports)


@contextmanager
def _plain_sampling(model: Any) -> Iterator[None]:
    """``model.generation_config`` without its sampling processors while a rollout generates.

    ``generate`` fills every setting a call leaves unset from the model's own config, so a
    checkpoint's ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_p``, ``min_new_tokens``
    or ``suppress_tokens`` (Qwen2.5-Instruct ships a repetition penalty) would change what is
    sampled, while the loss takes the plain tempered softmax: off-policy samples. Only the
    special token ids are kept.
    """
    from transformers import GenerationConfig

    saved = getattr(model, "generation_config", None)
    if saved is None:
        yield
        return
    keep = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id")
    model.generation_config = GenerationConfig(**{k: getattr(saved, k, None) for k in keep})
    try:
        yield
    finally:
        model.generation_config = saved


def _completion_mask(completion: torch.Tensor, eos: set[int]) -> torch.Tensor:
    """``[R, L]`` 1 up to and including the first EOS of each row (all 1 without EOS ids)."""
    if not eos:
        return torch.ones(completion.shape, dtype=torch.long, device=completion.device)
    is_eos = torch.zeros(completion.shape, dtype=torch.bool, device=completion.device)
    for e in eos:
        is_eos |= completion == e
    before = torch.cumsum(is_eos.long(), 1) - is_eos.long()  # EOS seen strictly before position t
    return (before == 0).long()


def _group_advantages(rewards: torch.Tensor, groups: torch.Tensor, *, scale: bool) -> torch.Tensor:
    """``[R]``: reward minus its group's mean, divided by the group's std (+1e-4) when ``scale``."""
    n = int(groups.max()) + 1
    count = torch.bincount(groups, minlength=n).float()
    mean = torch.zeros(n).index_add(0, groups, rewards) / count
    centred = rewards - mean[groups]
    # a group whose rewards are all equal has no signal: exactly 0, not the rounding of its mean
    # (0.1 x 8 summed in fp32 is off by an ulp; scaled by 1 / (std + 1e-4) and then by Adam's
    # normalisation, that ulp became a full step of a policy that learned nothing)
    low = torch.full((n,), float("inf")).scatter_reduce(0, groups, rewards, "amin")
    high = torch.full((n,), float("-inf")).scatter_reduce(0, groups, rewards, "amax")
    centred = torch.where((low == high)[groups], 0.0, centred)
    if not scale:
        return centred
    var = torch.zeros(n).index_add(0, groups, centred * centred) / count
    return centred / (var.sqrt()[groups] + 1e-4)

