"""Variable-length causal attention kernels for the local work of CP attention (forward and backward).

The problem (set up by :mod:`lightning_cp.parallel._allgather_attention` from a
:class:`~lightning_cp.parallel._key_selection.KeySelection`): ``q`` ``[Tq, Hq, D]``, ``k`` ``[Tk, Hkv, D]``
and ``v`` ``[Tk, Hkv, Dv]`` (``Hkv`` divides ``Hq``: grouped-query attention; ``Dv`` may differ from ``D``,
as in DeepSeek's multi-head latent attention) are cut into pieces by ``cu_q`` and ``cu_k`` (``[P + 1]``
boundaries); the queries of piece ``i`` attend to the keys of piece ``i`` only, causally with
bottom-right alignment: query ``j`` of a piece of ``lq`` queries and ``lk >= lq`` keys sees keys
``lk - lq + j - window < m <= lk - lq + j`` (``window=None``: from key 0). Every query therefore sees at
least one key (its own). The score of a visible pair is ``scale * q . k``, or with ``softcap``
``softcap * tanh(scale * q . k / softcap)`` (Gemma-2's attention logit softcapping: after the scaling,
before the mask and the softmax). Outputs are ``out`` ``[Tq, Hq, Dv]`` and the softmax log-sum-exp ``lse``
``[Hq, Tq]`` (fp32, or float64 for float64 inputs), which the backward reuses instead of keeping the
attention probabilities. Attention sinks are a correction of either kernel's result through ``lse``
(:func:`add_sinks`, :func:`sink_grad`).

Two kernels (:func:`use_flash` chooses, and logs its choice once):

- PyTorch's FlashAttention-2 variable-length kernels on CUDA GPUs of compute capability 8.0 or newer
  (fp16 / bf16, head dims up to 256 and multiples of 8), the ones behind ``torch.nn.attention.varlen.varlen_attn``; the aten ops are called
  directly so that the backward takes the saved ``lse`` (``varlen_attn``'s autograd would keep the keys).
  Windows go through their ``window_size_left`` / ``window_size_right``; a value head dim other than the
  query's is padded with zeros to the larger one (scores and outputs are unchanged). They have no
  softcap.
- the exact torch kernel (any device and dtype, computing in fp32): queries in blocks, each block's
  ``[heads, block, keys]`` scores bounded by ``SCORE_BLOCK_BYTES`` and recomputed in the backward, so
  memory is ``O(Tq + Tk)`` plus one block whatever the lengths (with a window, a block spans only the
  keys its queries reach). It is the CPU path (FlexAttention has no CPU backward), and on CUDA the path
  for fp32, for softcapping and for GPUs older than Ampere (a V100, a T4).
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor

_log = logging.getLogger(__name__)

SCORE_BLOCK_BYTES = 64 * 2**20
"""fp32 scores of one query block (the torch kernel): a few such temporaries at a time."""

_FLASH_CAPABILITY = (8, 0)
"""The oldest CUDA compute capability PyTorch's FlashAttention-2 kernels run on (Ampere)."""

Pieces = list[tuple[int, int, int, int]]
"""``(q_start, q_stop, k_start, k_stop)`` of every piece, on the host."""


def use_flash(q: Tensor, k: Tensor, v: Tensor, softcap: float | None) -> bool:
    """Whether the FlashAttention-2 kernels run for tensors like ``q``, ``k``, ``v`` (else the torch kernel):
    :func:`flash_chosen` of their device, dtypes and head dim."""
    return flash_chosen(q.device, (q.dtype, k.dtype, v.dtype), max(q.shape[-1], v.shape[-1]), softcap)


def flash_chosen(
    device: torch.device, dtypes: tuple[torch.dtype, ...], head_dim: int, softcap: float | None
) -> bool:
    """Whether the FlashAttention-2 kernels run for ``q``, ``k``, ``v`` of ``dtypes`` on ``device`` whose
    larger head dim is ``head_dim``: a CUDA GPU of compute capability 8.0 or newer, one dtype, fp16 or bf16,
    a head dim that is a multiple of 8 up to 256, FlashAttention enabled, no ``softcap``. Else the torch
    kernel.

    Logs once per process and reason which kernel runs (INFO; WARNING when a GPU takes the slower torch
    kernel for its generation (a V100, a T4), or inputs that could run FlashAttention because of ``softcap``).
    """
    if device.type != "cuda":
        reason = f"{device.type} tensors (FlashAttention-2 is CUDA only)"
    elif (capability := torch.cuda.get_device_capability(device)) < _FLASH_CAPABILITY:
        _log_once(
            logging.WARNING,
            "CP attention: the exact blocked torch kernel (fp32 scores, slower than FlashAttention), for a GPU "
            f"of compute capability {capability[0]}.{capability[1]}: FlashAttention-2 needs "
            f"{_FLASH_CAPABILITY[0]}.{_FLASH_CAPABILITY[1]} or newer (A100, H100).",
        )
        return False
    elif len(set(dtypes)) > 1:
        reason = f"q, k, v of different dtypes {', '.join(map(str, dtypes))} (FlashAttention-2 takes one)"
    elif dtypes[0] not in (torch.float16, torch.bfloat16):
        reason = f"{dtypes[0]} inputs (FlashAttention-2 takes fp16 / bf16)"
    elif head_dim % 8 or head_dim > 256:
        reason = f"head dim {head_dim} (FlashAttention-2 takes multiples of 8 up to 256)"
    elif not torch.backends.cuda.flash_sdp_enabled():
        reason = "FlashAttention disabled (torch.backends.cuda.enable_flash_sdp(False))"
    elif softcap is not None:
        _log_once(
            logging.WARNING,
            "CP attention: attention logit softcapping runs in the exact blocked torch kernel (fp32 "
            "scores, slower than FlashAttention): PyTorch's FlashAttention-2 kernels have no softcap.",
        )
        return False
    else:
        _log_once(logging.INFO, "CP attention: FlashAttention-2 varlen kernels (CUDA).")
        return True
    _log_once(logging.INFO, f"CP attention: the exact blocked torch kernel, for {reason}.")
    return False


@functools.cache
def _log_once(level: int, message: str) -> None:
    _log.log(level, message)


def _window_arguments(window: int | None) -> dict[str, int]:
    """FlashAttention-2's window: ``window - 1`` keys before the (bottom-right aligned) diagonal, none after."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def _pad_head_dim(x: Tensor, dim: int) -> Tensor:
    return x if x.shape[-1] == dim else F.pad(x, (0, dim - x.shape[-1]))


def flash_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    window: int | None = None,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """FlashAttention-2 varlen forward, causal (bottom-right), optionally windowed: ``(out, lse, rng)``."""
    dim = max(q.shape[-1], v.shape[-1])
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        _pad_head_dim(q, dim),
        _pad_head_dim(k, dim),
        _pad_head_dim(v, dim),
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        True,
        False,
        scale=scale,
        **_window_arguments(window),
    )
    return out[..., : v.shape[-1]].contiguous(), lse, (rng_state, unused)


def flash_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    rng: tuple[Tensor, Tensor],
    window: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2 varlen backward from the saved ``out`` and ``lse``: ``(dq, dk, dv)``."""
    dim = max(q.shape[-1], v.shape[-1])
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _pad_head_dim(dout.contiguous(), dim),
        _pad_head_dim(q, dim),
        _pad_head_dim(k, dim),
        _pad_head_dim(v, dim),
        _pad_head_dim(out, dim),
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        True,
        *rng,
        scale=scale,
        **_window_arguments(window),
    )
    return dq[..., : q.shape[-1]], dk[..., : k.shape[-1]], dv[..., : v.shape[-1]]


def _block_rows(queries: int, keys: int, heads: int, window: int | None) -> int:
    """Queries per block: their ``[heads, rows, keys spanned]`` fp32 scores fit ``SCORE_BLOCK_BYTES``.

    A block of ``rows`` queries spans at most ``keys`` keys, and with a window at most
    ``rows + window - 1``: the larger of the two row counts that fit is taken.
    """
    cells = SCORE_BLOCK_BYTES // (4 * heads)
    rows = cells // keys
    if window is not None:  # the largest rows with rows * (rows + window - 1) <= cells
        reach = window - 1
        rows = max(rows, (math.isqrt(reach * reach + 4 * cells) - reach) // 2)
    return max(1, min(queries, rows))


def _blocks(pieces: Pieces, heads: int, window: int | None = None) -> list[tuple[int, int, int, int, int]]:
    """``(q_start, q_stop, k_start, k_stop, diagonal)`` of every query block of every piece.

    A block of queries ``[j0, j1)`` of a piece needs its keys ``[first, lk - lq + j1)`` with ``first = 0``,
    or ``lk - lq + j0 - window + 1`` (at least 0) with a window; ``diagonal`` is ``lk - lq + j0 - first``,
    the last of those keys the block's first query sees.
    """
    blocks = []
    for q0, q1, k0, k1 in pieces:
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        rows = _block_rows(lq, lk, heads, window)
        for j0 in range(0, lq, rows):
            j1 = min(j0 + rows, lq)
            first = 0 if window is None else max(0, lk - lq + j0 - window + 1)
            blocks.append((q0 + j0, q0 + j1, k0 + first, k0 + lk - lq + j1, lk - lq + j0 - first))
    return blocks


def _logits(qb: Tensor, kb: Tensor, scale: float, softcap: float | None) -> Tensor:
    """Scores ``[Hkv, g, b, keys]`` (fp32) of queries ``qb`` ``[b, Hkv, g, D]`` against ``kb``, capped."""
    s = torch.einsum("bhgd,khd->hgbk", qb, kb).mul_(scale)
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    return s


def _mask_(s: Tensor, diagonal: int, window: int | None) -> Tensor:
    """``s`` with ``-inf`` where row ``r`` may not see key ``t``: ``t > diagonal + r`` or out of the window."""
    rows, keys = s.shape[-2:]
    key = torch.arange(keys, device=s.device)
    last = torch.arange(rows, device=s.device).add_(diagonal).unsqueeze(1)  # each row's diagonal key
    hidden = key > last
    if window is not None:
        hidden |= key <= last - window
    return s.masked_fill_(hidden, float("-inf"))


def _acc(x: Tensor) -> Tensor:
    """``x`` in the kernel's accumulation dtype: fp32, or the input's when wider."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """``[t, Hq, D]`` as ``[t, Hkv, g, D]`` (accumulation dtype): query heads grouped by their key head."""
    return _acc(x).unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def torch_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pieces: Pieces,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact blocked forward on any device: ``(out [Tq, Hq, Dv] in q's dtype, lse [Hq, Tq])``.

    Computes in fp32 (float64 for float64 inputs); ``lse`` is kept in that precision.
    """
    kv_heads = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=acc, device=q.device)
    lse = torch.zeros((q.shape[1], q.shape[0]), dtype=acc, device=q.device)
    for q0, q1, k0, k1, diagonal in _blocks(pieces, q.shape[1], window):
        s = _logits(_grouped(q[q0:q1], kv_heads), _acc(k[k0:k1]), scale, softcap)
        s = _mask_(s, diagonal, window)
        block_lse = torch.logsumexp(s, dim=-1)
        p = s.sub_(block_lse.unsqueeze(-1)).exp_()
        out[q0:q1] = torch.einsum("hgbk,khd->bhgd", p, _acc(v[k0:k1])).flatten(1, 2)
        lse[:, q0:q1] = block_lse.flatten(0, 1)
        del s, p  # this block's scores, before the next block's are made
    return out.to(q.dtype), lse


def torch_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    pieces: Pieces,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact blocked backward recomputing each block's probabilities from ``lse``: ``(dq, dk, dv)``, ``dq``
    in ``q``'s dtype, ``dk`` and ``dv`` in the accumulation dtype (fp32, or float64 for float64 inputs): a
    key's gradient is a sum over the queries that read it, which CP attention goes on summing over the
    ranks before it rounds once to the keys' dtype."""
    kv_heads = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for q0, q1, k0, k1, diagonal in _blocks(pieces, q.shape[1], window):
        qb, kb, vb = _grouped(q[q0:q1], kv_heads), _acc(k[k0:k1]), _acc(v[k0:k1])
        dob = _grouped(dout[q0:q1], kv_heads)
        block_lse = lse[:, q0:q1].unflatten(0, (kv_heads, -1))
        s = _logits(qb, kb, scale, softcap)
        # d(softcap * tanh(x / softcap)) / dx = 1 - tanh^2, from the capped scores before masking.
        slope = None if softcap is None else s.div(softcap).square_().neg_().add_(1)
        p = _mask_(s, diagonal, window).sub_(block_lse.unsqueeze(-1)).exp_()
        dv[k0:k1] += torch.einsum("hgbk,bhgd->khd", p, dob)
        # D_i = sum_d dO_i * O_i: the softmax backward's row term.
        delta = (dob * _grouped(out[q0:q1], kv_heads)).sum(-1).permute(1, 2, 0)
        ds = p.mul_(torch.einsum("bhgd,khd->hgbk", dob, vb).sub_(delta.unsqueeze(-1)))
        if slope is not None:
            ds.mul_(slope)
        ds.mul_(scale)
        dq[q0:q1] = torch.einsum("hgbk,khd->bhgd", ds, kb).flatten(1, 2)
        dk[k0:k1] += torch.einsum("hgbk,bhgd->khd", ds, qb)
        del s, slope, p, ds  # this block's scores, before the next block's are made
    return dq.to(q.dtype), dk, dv


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Fold attention sinks into a kernel's ``out`` ``[Tq, Hq, Dv]`` and ``lse`` ``[Hq, Tq]``.

    A sink (gpt-oss) is one learned logit per query head, ``sinks`` ``[Hq]``, that joins every query's
    softmax denominator and carries no value: the output becomes ``out * sigmoid(lse - sink)`` and the
    log-sum-exp ``logaddexp(lse, sink)``. Either kernel's backward, given these two, returns the exact
    ``dq``, ``dk``, ``dv`` (it recomputes the probabilities from the log-sum-exp, and the sink column, which
    has no value, enters only through it and through ``rowsum(dO * O)``); :func:`sink_grad` gives the
    sinks' own gradient.
    """
    total = torch.logaddexp(lse, sinks.to(lse.dtype).unsqueeze(1))
    kept = torch.exp(lse - total)  # sigmoid(lse - sink): the share of the real keys
    return (_acc(out) * kept.T.unsqueeze(-1)).to(out.dtype), total


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``[Hq]`` gradient of the sinks from :func:`add_sinks`' ``out`` and ``lse``.

    The sink's probability is ``exp(sink - lse)`` and its value is zero, so its logit's gradient is
    ``-exp(sink - lse) * rowsum(dO * O)``, summed over this rank's queries.
    """
    delta = (_acc(dout) * _acc(out)).sum(-1).T
    return -(torch.exp(sinks.to(lse.dtype).unsqueeze(1) - lse) * delta).sum(1).to(sinks.dtype)
