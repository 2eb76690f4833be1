"""The plain-PyTorch backend for one chunk of logits: statistics and the in-place logits gradient.

A chunk owns one fp32 ``[n, V_local]`` buffer: its logits, which the gradient then overwrites. Every
other temporary (the ``exp``, the coefficient products, the softcap slope) is taken over a block of
columns at a time, so the peak memory of a chunk is one fp32 buffer plus a few blocks of at most
``_BLOCK_ELEMENTS`` values, rather than two or three full buffers. The ``exp`` of the statistics pass is
recomputed by the gradient pass (one more elementwise pass, no more matmuls).
"""

from __future__ import annotations

import torch

from lightning_cp.ops import _partials

# Values per elementwise block (16 MiB of fp32): a few such temporaries are a small fraction of a chunk
# (512 MiB by default), and blocks stay large enough for vectorized kernels.
_BLOCK_ELEMENTS = 2**22
_MIN_BLOCK_COLUMNS = 256


def _blocks(rows: int, width: int) -> list[tuple[int, int]]:
    """Column ranges of the blocks of an ``[rows, width]`` chunk."""
    step = max(_MIN_BLOCK_COLUMNS, _BLOCK_ELEMENTS // max(rows, 1))
    return [(v0, min(v0 + step, width)) for v0 in range(0, width, step)]


class TorchChunk:
    """One chunk of logits ``z`` ``[n, V_local]`` (any float dtype) with its local labels ``[n]``.

    ``local_labels`` holds the label's index in this vocabulary shard, or -1 where the label is ignored
    or lives on another shard. The logits are upcast to fp32 once and transformed to
    ``s = softcap * tanh(logit_scale * z / softcap) * inv_temp`` (``logit_scale * z * inv_temp`` without a
    cap); ``writable`` says whether ``z`` may be overwritten (the fused linear path owns its chunk; a
    user's logits tensor must stay intact).
    """

    def __init__(
        self,
        z: torch.Tensor,
        local_labels: torch.Tensor,
        *,
        logit_scale: float,
        softcap: float | None,
        inv_temp: float,
        writable: bool,
    ) -> None:
        s = z.float()
        if softcap is not None or logit_scale * inv_temp != 1.0:
            if s is z and not writable:
                s = s.clone()
            if softcap is not None:
                s.mul_(logit_scale / softcap).tanh_().mul_(softcap * inv_temp)
            else:
                s.mul_(logit_scale * inv_temp)
        self._s = s
        self._owned = writable or s is not z
        self._labels = local_labels
        self._softcap = softcap
        self._inv_temp = inv_temp

    def partial_stats(self, *, entropy: bool, smoothing: bool) -> torch.Tensor:
        """The ``[NUM_STATS, n]`` fp32 partials of this shard (layout in :mod:`lightning_cp.ops._partials`)."""
        s, labels = self._s, self._labels
        out = s.new_zeros((_partials.NUM_STATS, s.shape[0]))
        row_max, argmax = s.max(dim=1)
        target = s.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
        out[_partials.MAX] = row_max
        out[_partials.TARGET] = torch.where(labels >= 0, target, 0.0)
        out[_partials.ARGMAX].view(torch.int32).copy_(argmax)
        if smoothing:
            out[_partials.SUM] = s.sum(dim=1)
        shift = row_max.unsqueeze(1)
        # A -inf logit (a masked vocabulary entry) has exp 0 and must add 0 to sum_j e_j (s_j - m), not
        # 0 * -inf = nan: the entropy product uses the lowest finite float instead.
        lowest = torch.finfo(torch.float32).min
        for v0, v1 in _blocks(*s.shape):
            block = s[:, v0:v1]
            exp = torch.sub(block, shift).exp_()
            out[_partials.SUMEXP] += exp.sum(dim=1)
            if entropy:
                finite = block.clamp(min=lowest).sub_(shift)
                # A batched dot product: no [n, block] product temporary.
                out[_partials.SHIFTED] += torch.bmm(exp.unsqueeze(1), finite.unsqueeze(2)).view(-1)
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
        the loss (see ``_engine``), ``ds/dz`` is the softcap slope ``1 - tanh^2`` (the temperature and the
        logit scale are folded into the coefficients). Written block by block into ``out`` (any float dtype) when given,
        else over the chunk's own fp32 buffer (a new one if the logits belong to the caller), which is
        returned. The chunk is consumed.
        """
        s, labels = self._s, self._labels
        dest = out if out is not None else s if self._owned else torch.empty_like(s)
        lse, alpha = lse.unsqueeze(1), alpha.unsqueeze(1)
        label_delta = torch.where(labels >= 0, -gamma, 0.0).unsqueeze(1)
        for v0, v1 in _blocks(*s.shape):
            block = s[:, v0:v1]
            width = v1 - v0
            p = torch.sub(block, lse).exp_()
            p.mul_(alpha if beta is None else torch.addcmul(alpha, beta.unsqueeze(1), block))
            if eta is not None:
                p.sub_(eta.unsqueeze(1))
            column = labels - v0
            here = (column >= 0) & (column < width)
            p.scatter_add_(
                1, column.clamp(0, width - 1).unsqueeze(1), torch.where(here.unsqueeze(1), label_delta, 0.0)
            )
            if self._softcap is not None:
                # tanh(z / softcap) = s / (softcap * inv_temp)
                p.mul_(torch.mul(block, 1.0 / (self._softcap * self._inv_temp)).square_().neg_().add_(1.0))
            dest[:, v0:v1].copy_(p)
        return dest
