"""The autograd function of :func:`lightning_cp.ops.linear_cross_entropy`: LM head + cross-entropy, fused."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from lightning_cp.ops import _engine as engine
from lightning_cp.ops import _formulas as formulas
from lightning_cp.ops._plan import Plan
from lightning_cp.ops.token_stats import TokenStats


class LinearCrossEntropy(torch.autograd.Function):
    """The cross-entropy loss of ``hidden @ weight.T + bias`` (``bias`` may be ``None``); fills ``stats``
    (see the engine's docstring). ``need`` says which of ``hidden``, ``weight``, ``bias`` need gradients.

    For ``mean`` / ``sum`` with gradients needed, they are computed in the forward and the backward only
    scales them; for ``none`` the backward recomputes the chunk logits.
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
        opts: formulas.CEOptions,
        need: tuple[bool, bool, bool],
    ) -> torch.Tensor:
        fused = any(need) and opts.reduction != "none"
        if fused:
            row_weight = stats.valid.float()
            ctx.grads = engine.linear_grads(
                plan,
                hidden,
                (weight, bias),
                labels,
                lambda a, b: formulas.ce_coefs(stats.lse[a:b], row_weight[a:b], opts, plan.vocab),
                need=need,
                stats=stats,
            )
        else:
            engine.sweep(
                plan, labels, engine.linear_logits(engine.Head(hidden, weight, bias, plan)), stats=stats
            )
            if any(need):
                ctx.save_for_backward(hidden, weight, bias, labels, stats.valid, stats.lse)
        count = stats.valid.sum()
        ctx.plan, ctx.opts, ctx.need, ctx.fused, ctx.count = plan, opts, need, fused, count
        return formulas.reduce_loss(formulas.ce_token_loss(stats, opts, plan.vocab), count, opts.reduction)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan, opts = ctx.plan, ctx.opts
        if ctx.fused:
            if ctx.grads is None:
                raise RuntimeError(
                    "linear_cross_entropy computed its gradients during the forward and scaled them in "
                    "place in the first backward; a second backward through the same loss is not "
                    "supported. Recompute the loss instead of using retain_graph=True."
                )
            grads = ctx.grads
            ctx.grads = None
            scale = formulas.output_scale(grad_loss, ctx.count, opts.reduction)
            for g in grads:
                if g is not None:
                    g.mul_(scale)
        else:
            hidden, weight, bias, labels, valid, lse = ctx.saved_tensors
            row_weight = grad_loss.float() * valid
            grads = engine.linear_grads(
                plan,
                hidden,
                (weight, bias),
                labels,
                lambda a, b: formulas.ce_coefs(lse[a:b], row_weight[a:b], opts, plan.vocab),
                need=ctx.need,
            )
        grad_hidden, grad_weight, grad_bias = grads
        engine.sum_over_shards(grad_hidden, plan.group)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None
