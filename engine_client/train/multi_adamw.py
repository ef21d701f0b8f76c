"""AdamW over parameters stacked by policy: every policy its own state and hyper-parameters.

A stack parameter is ``[N, ...]`` with row ``i`` = policy ``i``. One update runs for all
rows at once (a few element-wise ops per parameter, not N optimizers), and is, row by row,
PyTorch's ``AdamW`` (decoupled weight decay, bias-corrected moments) with that policy's
``lr``, ``betas``, ``eps``, ``weight_decay`` and step count, after clipping that policy's
gradient to ``max_grad_norm`` over all its parameters (``clip_grad_norm_``'s rule:
``coef = min(1, max_norm / (norm + 1e-6))``).

Which rows move: only the rows in ``active``. A row outside it keeps its parameters,
moments and step count bit for bit; ``torch.optim.AdamW`` would still move a parameter
whose gradient is zero (momentum, and the decoupled weight decay ``p *= 1 - lr * wd``),
so a policy that had no training signal in a step would drift. The trainer passes the
policies that got a non-zero gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimConfig:
    """One policy's optimizer settings (AdamW, plus gradient clipping by that policy's norm)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # None: no clipping

    def __post_init__(self) -> None:
        if not self.lr >= 0 or not self.eps >= 0 or not self.weight_decay >= 0:
            raise ValueError("lr, eps and weight_decay must be >= 0")
        if not all(0.0 <= b < 1.0 for b in self.betas) or len(self.betas) != 2:
            raise ValueError("betas must be two numbers in [0, 1)")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError("max_grad_norm must be > 0 (or None)")


class StackedAdamW:
    """Moments for named stack parameters; :meth:`step` updates the active rows."""

    def __init__(self) -> None:
        self.exp_avg: dict[str, torch.Tensor] = {}  # name -> [N, ...] like the parameter
        self.exp_avg_sq: dict[str, torch.Tensor] = {}
        self.steps: list[int] = []  # per row

    def resize(self, params: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Match the rows of ``params`` (grown at the end): new rows start with zero moments."""
        n = int(params[0][1].shape[0]) if params else 0
        grown: list[dict[str, torch.Tensor]] = [{}, {}]
        for name, p in params:  # all made before any is swapped in: a failure leaves the state as it was
            for state, out in zip((self.exp_avg, self.exp_avg_sq), grown, strict=True):
                old = state.get(name)
                new = torch.zeros_like(p, memory_format=torch.contiguous_format)
                if old is not None:
                    new[: old.shape[0]].copy_(old)
                out[name] = new
        self.exp_avg.update(grown[0])
        self.exp_avg_sq.update(grown[1])
        self.steps += [0] * (n - len(self.steps))

    def reset(self, row: int) -> None:
        """Forget one policy's moments and step count (its weights were replaced)."""
        for state in (*self.exp_avg.values(), *self.exp_avg_sq.values()):
            state[row].zero_()
        self.steps[row] = 0

    @torch.no_grad()
    def grad_norms(self, params: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
        """``[N]`` float32 L2 norm of each row's gradient over all ``params`` (missing grad: 0)."""
        n = int(params[0][1].shape[0])
        sq = torch.zeros(n, dtype=torch.float32, device=params[0][1].device)
        for _, p in params:
            if p.grad is not None:
                sq += p.grad.float().pow(2).flatten(1).sum(1)
        return sq.sqrt()

    @torch.no_grad()
    def step(
        self,
        params: Sequence[tuple[str, torch.Tensor]],
        configs: Sequence[OptimConfig],
        active: Sequence[bool],
        norms: torch.Tensor,
    ) -> None:
        """One AdamW update of the ``active`` rows; ``norms [N]`` from :meth:`grad_norms` (clipping)."""
        if not params or not any(active):
            return
        dev = params[0][1].device
        steps = [s + int(a) for s, a in zip(self.steps, active, strict=True)]

        def col(values: Sequence[float]) -> torch.Tensor:  # [N] float32 on the device
            return torch.tensor(values, dtype=torch.float32, device=dev)

        # per-row scalars, computed in float64 on the host as torch's AdamW does
        bc1 = [1 - c.betas[0] ** s if a else 1.0 for c, s, a in zip(configs, steps, active, strict=True)]
        bc2 = [1 - c.betas[1] ** s if a else 1.0 for c, s, a in zip(configs, steps, active, strict=True)]
        step_size = col([c.lr / b for c, b in zip(configs, bc1, strict=True)])
        bc2_sqrt = col([math.sqrt(b) for b in bc2])
        decay = col([1 - c.lr * c.weight_decay for c in configs])
        # 1 - beta in float64 first: 1 - float32(0.999) is off by 1e-5 relative
        w1 = col([1 - c.betas[0] for c in configs])
        beta2 = col([c.betas[1] for c in configs])
        w2 = col([1 - c.betas[1] for c in configs])
        eps = col([c.eps for c in configs])
        clip = torch.ones_like(norms)
        for i, c in enumerate(configs):
            if c.max_grad_norm is not None:
                clip[i] = torch.clamp(c.max_grad_norm / (norms[i] + 1e-6), max=1.0)
        live = torch.tensor(list(active), dtype=torch.bool, device=dev)

        for name, p in params:
            if p.grad is None:
                continue
            shape = (-1,) + (1,) * (p.dim() - 1)  # broadcast [N] over a row
            m, v = self.exp_avg[name], self.exp_avg_sq[name]
            g = p.grad * clip.view(shape).to(p.grad.dtype)
            # in float32 then rounded, as torch's lerp takes a float weight: 1 - 0.9 in bf16 is 0.10009765625
            m_new = m.float().lerp(g.float(), w1.view(shape)).to(m.dtype)
            v_new = v * beta2.view(shape) + w2.view(shape) * g * g
            denom = v_new.sqrt() / bc2_sqrt.view(shape) + eps.view(shape)
            p_new = p * decay.view(shape) - step_size.view(shape) * m_new / denom  # torch's order of operations
            keep = live.view(shape)
            # where, not a masked multiply: inactive rows must come back bit-identical
            p.copy_(torch.where(keep, p_new.to(p.dtype), p))
            m.copy_(torch.where(keep, m_new, m))
            v.copy_(torch.where(keep, v_new, v))
        self.steps = steps
