"""The Triton backend for one chunk of logits (Liger-style: cuBLAS matmuls around two row kernels).

The logits chunk ``z`` ``[n, V_local]`` stays in its input dtype. One program per row streams the row
in ``BLOCK``-wide tiles with the online-softmax recurrence (running max, rescaled sum of exponentials,
first argmax, ``sum e * (s - m)`` for the entropy, ``sum s`` for label smoothing) and writes the
``[NUM_STATS, n]`` partials of :mod:`lightning_cp.ops._partials`. After the partials are merged (over the
tensor-parallel group if any), a second kernel rereads the row and writes ``dL/dz`` *in place* over the
logits, so the gradient costs no memory beyond the chunk itself.

This module imports Triton at import time and is only imported when the Triton path is used, so that
``TRITON_INTERPRET=1`` (read when ``@triton.jit`` decorates the kernels) can be set before.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from lightning_cp.ops import _partials

# Widest tile a program holds in registers; wider vocabularies loop over tiles.
_MAX_BLOCK = 4096


@triton.jit
def _tanh(x):
    # Portable tanh (no libdevice, so the interpreter runs it too); saturates to +-1 without overflow.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _partial_stats_kernel(
    z_ptr,
    stride_z,
    labels_ptr,
    max_ptr,
    sumexp_ptr,
    target_ptr,
    argmax_ptr,
    shifted_ptr,
    total_ptr,
    n_cols,
    logit_scale,
    softcap,
    inv_temp,
    HAS_SOFTCAP: tl.constexpr,
    ENTROPY: tl.constexpr,
    SMOOTHING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    label = tl.load(labels_ptr + row)

    row_max = float("-inf")
    sumexp = 0.0
    shifted = 0.0
    total = 0.0
    best = 0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        s = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            s = softcap * inv_temp * _tanh(s * (logit_scale / softcap))
        else:
            s = s * (logit_scale * inv_temp)
        if SMOOTHING:
            total += tl.sum(tl.where(mask, s, 0.0), axis=0)
        s = tl.where(mask, s, float("-inf"))
        block_max, block_arg = tl.max(s, axis=0, return_indices=True, return_indices_tie_break_left=True)
        new_max = tl.maximum(row_max, block_max)
        # Strictly greater: an earlier tile keeps the first maximum on ties.
        best = tl.where(block_max > row_max, start + block_arg, best)
        rescale = tl.exp(row_max - new_max)
        e = tl.exp(s - new_max)
        if ENTROPY:
            # Re-centre the running sum on the new maximum. The guards keep (-inf) * 0 out: the running
            # maximum is -inf before the first tile, and masked lanes (or -inf logits) have e = 0.
            recentred = tl.where(sumexp > 0.0, row_max - new_max, 0.0) * sumexp
            shifted = rescale * (shifted + recentred) + tl.sum(
                tl.where(e > 0.0, s - new_max, 0.0) * e, axis=0
            )
        sumexp = sumexp * rescale + tl.sum(e, axis=0)
        row_max = new_max

    z_label = tl.load(z_row + tl.maximum(label, 0)).to(tl.float32)
    if HAS_SOFTCAP:
        s_label = softcap * inv_temp * _tanh(z_label * (logit_scale / softcap))
    else:
        s_label = z_label * (logit_scale * inv_temp)
    tl.store(max_ptr + row, row_max)
    tl.store(sumexp_ptr + row, sumexp)
    tl.store(target_ptr + row, tl.where(label >= 0, s_label, 0.0))
    tl.store(argmax_ptr + row, best)
    if ENTROPY:
        tl.store(shifted_ptr + row, shifted)
    if SMOOTHING:
        tl.store(total_ptr + row, total)


@triton.jit
def _grad_kernel(
    z_ptr,
    stride_z,
    out_ptr,
    stride_out,
    labels_ptr,
    lse_ptr,
    alpha_ptr,
    gamma_ptr,
    beta_ptr,
    eta_ptr,
    n_cols,
    logit_scale,
    softcap,
    inv_temp,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_ETA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    out_row = out_ptr + row * stride_out
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    alpha = tl.load(alpha_ptr + row)
    gamma = tl.load(gamma_ptr + row)
    if HAS_BETA:
        beta = tl.load(beta_ptr + row)
    else:
        beta = 0.0
    if HAS_ETA:
        eta = tl.load(eta_ptr + row)
    else:
        eta = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        z = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            t = _tanh(z * (logit_scale / softcap))
            s = softcap * inv_temp * t
        else:
            s = z * (logit_scale * inv_temp)
        p = tl.exp(s - lse)
        if HAS_BETA:
            d = p * (alpha + beta * s)
        else:
            d = p * alpha
        d = tl.where(cols == label, d - gamma, d) - eta
        if HAS_SOFTCAP:
            d = d * (1.0 - t * t)
        tl.store(out_row + cols, d.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_config(n_cols: int) -> tuple[int, int]:
    block = min(_MAX_BLOCK, triton.next_power_of_2(n_cols))
    return block, 8 if block >= 2048 else 4


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device; make it the tensor's one.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


class TritonChunk:
    """One chunk of logits ``z`` ``[n, V_local]`` (fp32 / bf16 / fp16) with its local labels ``[n]``.

    Same contract as :class:`lightning_cp.ops._torch_kernels.TorchChunk`: ``local_labels`` is the
    label's index in this shard or -1; ``s = softcap * tanh(logit_scale * z / softcap) * inv_temp``;
    ``writable`` lets :meth:`grad` overwrite ``z`` with the gradient.
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
        contiguous = z if z.stride(1) == 1 else z.contiguous()
        self._z = contiguous
        self._writable = writable or contiguous is not z
        self._labels = local_labels.contiguous()
        self._logit_scale = logit_scale
        self._softcap = softcap
        self._inv_temp = inv_temp

    def partial_stats(self, *, entropy: bool, smoothing: bool) -> torch.Tensor:
        """The ``[NUM_STATS, n]`` fp32 partials of this shard (layout in :mod:`lightning_cp.ops._partials`)."""
        z = self._z
        n, n_cols = z.shape
        out = torch.zeros((_partials.NUM_STATS, n), dtype=torch.float32, device=z.device)
        block, warps = _launch_config(n_cols)
        with _on_device(z):
            _partial_stats_kernel[(n,)](
                z,
                z.stride(0),
                self._labels,
                out[_partials.MAX],
                out[_partials.SUMEXP],
                out[_partials.TARGET],
                out[_partials.ARGMAX].view(torch.int32),
                out[_partials.SHIFTED],
                out[_partials.SUM],
                n_cols,
                self._logit_scale,
                self._softcap or 1.0,
                self._inv_temp,
                HAS_SOFTCAP=self._softcap is not None,
                ENTROPY=entropy,
                SMOOTHING=smoothing,
                BLOCK=block,
                num_warps=warps,
            )
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
        """Gradient w.r.t. ``z`` (formula in ``TorchChunk.grad``), in ``z``'s dtype.

        Written into ``out`` when given, else over ``z`` itself when writable, else into a new buffer.
        """
        z = self._z
        if out is None:
            out = z if self._writable else torch.empty_like(z)
        n, n_cols = z.shape
        block, warps = _launch_config(n_cols)
        with _on_device(z):
            _grad_kernel[(n,)](
                z,
                z.stride(0),
                out,
                out.stride(0),
                self._labels,
                lse.contiguous(),
                alpha.contiguous(),
                gamma.contiguous(),
                alpha if beta is None else beta.contiguous(),
                alpha if eta is None else eta.contiguous(),
                n_cols,
                self._logit_scale,
                self._softcap or 1.0,
                self._inv_temp,
                HAS_SOFTCAP=self._softcap is not None,
                HAS_BETA=beta is not None,
                HAS_ETA=eta is not None,
                BLOCK=block,
                num_warps=warps,
            )
        return out
