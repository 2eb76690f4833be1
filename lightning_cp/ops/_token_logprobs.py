"""The autograd function of :func:`lightning_cp.ops.token_logprobs`: per-token log-probs and entropy."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from lightning_cp.ops import _engine as engine
from lightning_cp.ops import _formulas as formulas
from lightning_cp.ops._plan import Plan
from lightning_cp.ops.token_stats import TokenStats


class LinearLogprobs(torch.autograd.Function):
    """``(logprobs [N], entropy [N] | None)`` under ``softmax(transform(hidden @ weight.T + bias))``; fills
    ``stats``. ``need`` says which of ``hidden``, ``weight``, ``bias`` need gradients.

    The backward takes per-token upstream gradients and recomputes the chunk logits.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        stats: TokenStats,
        plan: Plan,
        need: tuple[bool, bool, bool],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        engine.sweep(plan, labels, engine.linear_logits(engine.Head(hidden, weight, bias, plan)), stats=stats)
        logprobs = torch.where(stats.valid, stats.target - stats.lse, 0.0)
        ctx.plan, ctx.need = plan, need
        if any(need):
            mean_s = None if stats.entropy is None else stats.lse - stats.entropy
            ctx.save_for_backward(hidden, weight, bias, labels, stats.valid, stats.lse, mean_s)
        return logprobs, stats.entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.plan
        hidden, weight, bias, labels, valid, lse, mean_s = ctx.saved_tensors
        g_lp = grad_logprobs.float() * valid
        g_ent = None if grad_entropy is None else grad_entropy.float() * valid
        grad_hidden, grad_weight, grad_bias = engine.linear_grads(
            plan,
            hidden,
            (weight, bias),
            labels,
            lambda a, b: formulas.logprob_coefs(
                lse[a:b],
                g_lp[a:b],
                None if g_ent is None else g_ent[a:b],
                None if mean_s is None else mean_s[a:b],
                plan.inv_temp,
            ),
            need=ctx.need,
        )
        engine.sum_over_shards(grad_hidden, plan.group)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None
