"""The autograd function of :func:`lightning_cp.ops.cross_entropy`: cross-entropy of materialized logits."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from lightning_cp.ops import _engine as engine
from lightning_cp.ops import _formulas as formulas
from lightning_cp.ops._plan import Plan
from lightning_cp.ops.token_stats import TokenStats


class LogitsCrossEntropy(torch.autograd.Function):
    """The cross-entropy loss of ``logits`` ``[N, V_local]``; fills ``stats``. The backward recomputes the
    softmax chunk by chunk from the saved per-token ``lse`` into one gradient buffer."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        stats: TokenStats,
        plan: Plan,
        opts: formulas.CEOptions,
    ) -> torch.Tensor:
        engine.sweep(plan, labels, engine.logits_slices(logits), stats=stats)
        count = stats.valid.sum()
        ctx.plan, ctx.opts = plan, opts
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logits, labels, stats.valid, stats.lse, count)
        return formulas.reduce_loss(formulas.ce_token_loss(stats, opts, plan.vocab), count, opts.reduction)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan, opts = ctx.plan, ctx.opts
        logits, labels, valid, lse, count = ctx.saved_tensors
        row_weight = formulas.output_scale(grad_loss.float(), count, opts.reduction) * valid
        grads = engine.LogitsGrads(logits)
        engine.sweep(
            plan,
            labels,
            engine.logits_slices(logits),
            coefs=lambda a, b: formulas.ce_coefs(lse[a:b], row_weight[a:b], opts, plan.vocab),
            sink=grads,
        )
        return grads.logits, None, None, None, None
