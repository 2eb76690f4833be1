"""The plain-PyTorch backend for one chunk of logits: statistics and the in-place logits gradient.

Each operation is a whole-chunk tensor op, so the work per chunk is a handful of passes over an fp32
``[n, V_local]`` buffer (the same passes ``log_softmax`` and its backward make), and the ``exp`` of the
statistics pass is reused by the gradient instead of being recomputed.
"""

from __future__ import annotations

import torch

from lightning_cp.ops import _stats


class TorchChunk:
    """One chunk of logits ``z`` ``[n, V_local]`` (any float dtype) with its local labels ``[n]``.

    ``local_labels`` holds the label's index in this vocabulary shard, or -1 where the label is ignored
    or lives on another shard. The logits are upcast to fp32 once and transformed to
    ``s = softcap * tanh(z / softcap) * inv_temp``; ``writable`` says whether ``z`` may be overwritten
    (the fused linear path owns its chunk; a user's logits tensor must stay intact).
    """

    def __init__(
        self,
        z: torch.Tensor,
        local_labels: torch.Tensor,
        *,
        softcap: float | None,
        inv_temp: float,
        writable: bool,
    ) -> None:
        s = z.float()
        if softcap is not None or inv_temp != 1.0:
            if s is z and not writable:
                s = s.clone()
            if softcap is not None:
                s.div_(softcap).tanh_().mul_(softcap * inv_temp)
            else:
                s.mul_(inv_temp)
        self._s = s
        self._owned = writable or s is not z
        self._labels = local_labels
        self._softcap = softcap
        self._inv_temp = inv_temp
        self._exp: torch.Tensor | None = None
        self._exp_offset: torch.Tensor | None = None

    def partial_stats(self, *, entropy: bool, smoothing: bool) -> torch.Tensor:
        """The ``[NUM_STATS, n]`` fp32 partials of this shard (layout in :mod:`lightning_cp.ops._stats`)."""
        s, labels = self._s, self._labels
        out = s.new_zeros((_stats.NUM_STATS, s.shape[0]))
        row_max, argmax = s.max(dim=1)
        exp = torch.sub(s, row_max.unsqueeze(1)).exp_()
        sumexp = exp.sum(dim=1)
        out[_stats.MAX] = row_max
        out[_stats.SUMEXP] = sumexp
        target = s.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
        out[_stats.TARGET] = torch.where(labels >= 0, target, 0.0)
        out[_stats.ARGMAX].view(torch.int32).copy_(argmax)
        if smoothing:
            out[_stats.SUM] = s.sum(dim=1)
        if entropy:
            # A -inf logit (a masked vocabulary entry) has e = 0 and must add 0 to sum_j e_j s_j, not
            # 0 * -inf = nan: clamp to the lowest finite float, in place unless s is the caller's tensor.
            lowest = torch.finfo(torch.float32).min
            finite = s.clamp_(min=lowest) if self._owned else s.clamp(min=lowest)
            # A batched dot product: no [n, V] product temporary.
            dot = torch.bmm(exp.unsqueeze(1), finite.unsqueeze(2)).view(-1)
            out[_stats.SHIFTED] = dot - row_max * sumexp
        self._exp, self._exp_offset = exp, row_max
        return out

    def grad(
        self,
        lse: torch.Tensor,
        alpha: torch.Tensor,
        gamma: torch.Tensor,
        beta: torch.Tensor | None = None,
        eta: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gradient w.r.t. ``z``: ``(p_j * (alpha + beta * s_j) - gamma * [j == label] - eta) * ds_j/dz_j``.

        ``p = softmax(s)`` comes from the global ``lse`` ``[n]``; the per-row coefficients ``[n]`` encode
        the loss (see ``_chunked``), ``ds/dz`` is the softcap slope ``1 - tanh^2`` (the temperature is
        folded into the coefficients). Returns the fp32 buffer, or ``out`` (any float dtype) filled
        with it. The chunk is consumed: its buffers are reused in place.
        """
        s = self._s
        if self._exp is not None:
            p = self._exp.mul_(torch.exp(self._exp_offset - lse).unsqueeze(1))
        else:
            p = torch.sub(s, lse.unsqueeze(1)).exp_()
        if beta is not None:
            p.mul_(torch.addcmul(alpha.unsqueeze(1), beta.unsqueeze(1), s))
        else:
            p.mul_(alpha.unsqueeze(1))
        if eta is not None:
            p.sub_(eta.unsqueeze(1))
        labels = self._labels
        p.scatter_add_(
            1, labels.clamp(min=0).unsqueeze(1), torch.where(labels >= 0, -gamma, 0.0).unsqueeze(1)
        )
        if self._softcap is not None:
            # tanh(z / softcap) = s / (softcap * inv_temp); the slope overwrites s, which is no longer needed.
            p.mul_(s.mul_(1.0 / (self._softcap * self._inv_temp)).square_().neg_().add_(1.0))
        self._exp = None
        if out is None:
            return p
        return out.copy_(p)
