"""Supervised fine-tuning of many policies in one batch: each row's next-token loss under its own
policy, normalised per policy. Half of :class:`~engine_client.train.trainer.MultiLoRATrainer`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import TrainerError
from .trainer_types import IGNORE_INDEX, SFTLoss, StepReport


class Supervised:
    def forward(self, input_ids: torch.Tensor, policies: Sequence[str | None], **model_kwargs: Any) -> Any:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def step(self, policies: Iterable[str] | None = None) -> StepReport:
        raise NotImplementedError

    def sft_loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, policies: Sequence[str],
        attention_mask: torch.Tensor | None = None,
    ) -> SFTLoss:
        """Next-token cross-entropy of ``labels [B, T]`` (-100: no loss) under each row's policy.

        Row ``i``'s position ``t`` predicts ``labels[i, t + 1]``, as transformers' ``labels=``.

        Parameters
        ----------
        input_ids, labels
            ``[B, T]`` tokens and their targets (``-100``: no loss).
        policies
            One policy name per row.
        attention_mask
            Passed to the model.

        Returns
        -------
        SFTLoss
            The loss to call ``backward`` on (each policy's token mean, summed: a policy's
            gradient is that of its own loss alone) and each policy's mean and token count.

        Raises
        ------
        TrainerError
            A row without a policy.
        ValueError
            ``labels`` not of the shape of ``input_ids``.
        """
        if any(p is None for p in policies):
            raise TrainerError("every row of a supervised batch needs a policy")
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        logits = self.forward(input_ids, policies, **kwargs).logits[:, :-1]  # [B, T-1, V]
        target = labels[:, 1:].to(logits.device)  # [B, T-1]
        ce = nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX,
            reduction="none",
        ).view(target.shape)
        valid = target != IGNORE_INDEX  # [B, T-1]
        per_row = (ce * valid).sum(1)  # [B]
        count_row = valid.sum(1)  # [B]
        weights, per_policy = _per_policy_weights(list(policies), count_row, per_row)
        loss = (per_row * weights.to(per_row.device)).sum()
        return SFTLoss(loss, per_policy)

    def sft_step(
        self, input_ids: torch.Tensor, labels: torch.Tensor, policies: Sequence[str],
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[SFTLoss, StepReport]:
        """:meth:`sft_loss`, backward, :meth:`step` (only the policies in this batch)."""
        self.zero_grad()
        out = self.sft_loss(input_ids, labels, policies, attention_mask)
        out.loss.backward()
        return out, self.step(set(policies))


def _per_policy_weights(
    policies: list[str], count_row: torch.Tensor, loss_row: torch.Tensor
) -> tuple[torch.Tensor, dict[str, tuple[float, int]]]:
    """``[B]`` weight ``1 / tokens of the row's policy`` (0 for a policy without tokens), and stats."""
    counts = count_row.tolist()
    losses = loss_row.detach().tolist()
    tok: dict[str, int] = {}
    tot: dict[str, float] = {}
    for p, c, v in zip(policies, counts, losses, strict=True):
        tok[p] = tok.get(p, 0) + int(c)
        tot[p] = tot.get(p, 0.0) + float(v)
    w = torch.tensor([1.0 / tok[p] if tok[p] else 0.0 for p in policies], dtype=torch.float32)
    return w, {p: (tot[p] / tok[p] if tok[p] else 0.0, tok[p]) for p in tok}
