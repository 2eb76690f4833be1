"""The global-token objective: the one place where the loss is normalized, and its gradient rescale.

The objective is the mean loss over every valid target token of the global batch: all DP and CP ranks
and all gradient-accumulation micro-batches of an optimizer step (``docs/design.md``, "How one batch
flows", step 5). Each rank only has its own tokens, so the mean cannot be taken locally (a CP-local
mean is wrong as soon as ranks hold different numbers of targets). Instead, with ``W = |DP x CP|`` ranks
whose gradients DDP / FSDP average, and ``N`` the global number of valid targets::

    rank loss = W * local_sum / N        =>   average of the ranks' gradients = grad(global_sum) / N.

``N`` of a micro-batch is one scalar all-reduce. With gradient accumulation over ``A`` micro-batches
``N`` is only known after the last one, so every micro-batch of the step is divided by the first
micro-batch's count ``N_1`` and, just before the optimizer step, the gradients are multiplied by
``A * N_1 / (N_1 + ... + N_A)``: the ``A`` undoes Lightning's own division of the loss by
``accumulate_grad_batches`` (applied exactly once, here), the rest turns ``1 / N_1`` into ``1 / N``.
Without accumulation the factor is exactly 1 and nothing is rescaled.

An auxiliary loss that is already a function of the whole global batch (the same value on every rank, its
gradient reaching each rank's own tokens: an MoE load-balancing loss) enters with its gradient scaled by
``W * N_i / N_1`` (its value unchanged): DDP's average then gives its gradient, and after the rescale each
micro-batch's value counts with its share ``N_i / N`` of the step's target tokens, like its tokens'
cross-entropy.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_cp.parallel.layout import ParallelLayout


class GlobalTokenObjective:
    """Normalizes per-rank loss sums into the global token mean across ranks and micro-batches.

    Call :meth:`totals` once per micro-batch (a collective over ``layout.loss_group``), :meth:`training_loss`
    for the loss to back-propagate, and :meth:`rescale_gradients` once before each optimizer step.
    """

    def __init__(self) -> None:
        self._reference_count: Tensor | None = None
        self._step_count: Tensor | None = None
        self._count: Tensor | None = None

    @staticmethod
    def totals(valid_count: Tensor, loss_sum: Tensor, layout: ParallelLayout) -> tuple[Tensor, Tensor]:
        """``(N, global loss sum)`` of a micro-batch: one all-reduce of two fp32 scalars over DP x CP."""
        totals = torch.stack([valid_count.to(torch.float32), loss_sum.detach().float()])
        if layout.loss_group is not None:
            dist.all_reduce(totals, group=layout.loss_group)
        count, global_sum = totals.unbind()
        return count, global_sum

    def training_loss(self, loss_sum: Tensor, count: Tensor, layout: ParallelLayout) -> Tensor:
        """``W * local_sum / N_1`` for this micro-batch (``N_1``: the first micro-batch's count of the step; any
        positive normalizer works as a count, e.g. a policy objective's number of sequences)."""
        if self._reference_count is None:
            self._reference_count = torch.where(count > 0, count, 1.0)  # a normalizer may be fractional
            self._step_count = torch.zeros_like(count)
        self._step_count += count
        self._count = count
        return loss_sum * (layout.dp * layout.cp) / self._reference_count

    def auxiliary_loss(self, value: Tensor, layout: ParallelLayout) -> Tensor:
        """``value`` (a loss of the whole global batch, module docstring) with its gradient scaled by
        ``W * N_i / N_1``, after :meth:`training_loss` of the same micro-batch ``i``."""
        if self._count is None:
            raise RuntimeError(
                "An auxiliary loss is weighted by its micro-batch's token count: compute lm_loss first in "
                "the same training step."
            )
        scale = (layout.dp * layout.cp) * self._count / self._reference_count
        return value + (scale - 1) * (value - value.detach())

    def rescale_gradients(self, parameters: Iterable[torch.nn.Parameter], accumulate: int) -> None:
        """Turn the first micro-batch's normalizer into the whole step's; starts the next step.

        Synchronizes with the device once (the factor read back), only when there is something to rescale."""
        reference, step_count = self._reference_count, self._step_count
        self._reference_count = self._step_count = self._count = None
        if reference is None or accumulate == 1:
            return
        # One number, read once per step: the gradients may live elsewhere than the counts (FSDP's cpu_offload
        # keeps them on the host, the counts come from the device).
        factor = float(accumulate * reference / torch.where(step_count > 0, step_count, 1.0))
        for param in parameters:
            if param.grad is not None:
                param.grad.mul_(factor)
