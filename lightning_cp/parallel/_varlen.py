"""Variable-length causal attention kernels for the local work of CP attention (forward and backward).

The problem (set up by :mod:`lightning_cp.parallel.attention`): ``q`` ``[Tq, Hq, D]`` and ``k``, ``v``
``[Tk, Hkv, D]`` (``Hkv`` divides ``Hq``: grouped-query attention) are cut into pieces by ``cu_q`` and
``cu_k`` (``[P + 1]`` boundaries); the queries of piece ``i`` attend to the keys of piece ``i`` only,
causally with bottom-right alignment: query ``j`` of a piece of ``lq`` queries and ``lk >= lq`` keys sees
keys ``0 .. lk - lq + j``. Every query therefore sees at least one key. Outputs are ``out`` ``[Tq, Hq, D]``
and the softmax log-sum-exp ``lse`` ``[Hq, Tq]`` (fp32, or float64 for float64 inputs), which the backward reuses instead of keeping
the attention probabilities.

Two kernels:

- :func:`flash_available`: PyTorch's FlashAttention-2 variable-length kernels on CUDA (fp16 / bf16), the
  ones behind ``torch.nn.attention.varlen.varlen_attn``; the aten ops are called directly so that the
  backward takes the saved ``lse`` (``varlen_attn``'s autograd would keep the keys).
- the exact torch kernel (any device and dtype, computing in fp32): queries in blocks, each block's
  ``[heads, block, keys]`` scores bounded by ``_SCORE_BUDGET_BYTES`` and recomputed in the backward, so
  memory is ``O(Tq + Tk)`` plus one block whatever the lengths. It is the CPU path (FlexAttention has no
  CPU backward) and the fallback for fp32 on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

_SCORE_BUDGET_BYTES = 64 * 2**20
"""fp32 scores of one query block (the torch kernel): a few such temporaries at a time."""

Pieces = list[tuple[int, int, int, int]]
"""``(q_start, q_stop, k_start, k_stop)`` of every piece, on the host."""


def flash_available(q: Tensor) -> bool:
    """Whether :func:`flash_forward` / :func:`flash_backward` run for tensors like ``q``."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and torch.backends.cuda.flash_sdp_enabled()
    )


def flash_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, scale: float
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """FlashAttention-2 varlen forward, causal (bottom-right). Returns ``(out, lse, rng)``."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
    )
    return out, lse, (rng_state, unused)


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
) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2 varlen backward from the saved ``out`` and ``lse``: ``(dq, dk, dv)``."""
    return torch.ops.aten._flash_attention_backward(
        dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, *rng, scale=scale
    )


def _blocks(pieces: Pieces, heads: int) -> list[tuple[int, int, int, int, int]]:
    """``(q_start, q_stop, k_start, k_stop, causal_offset)`` of every query block of every piece.

    A block of queries ``[j0, j1)`` of a piece needs its keys ``[0, lk - lq + j1)``; ``causal_offset`` is
    ``lk - lq + j0``, the last key the block's first query sees.
    """
    blocks = []
    for q0, q1, k0, k1 in pieces:
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        rows = max(1, min(lq, _SCORE_BUDGET_BYTES // (4 * heads * lk)))
        for j0 in range(0, lq, rows):
            j1 = min(j0 + rows, lq)
            blocks.append((q0 + j0, q0 + j1, k0, k0 + lk - lq + j1, lk - lq + j0))
    return blocks


def _scores(qb: Tensor, kb: Tensor, causal_offset: int, scale: float) -> Tensor:
    """Masked scores ``[Hkv, g, b, keys]`` (fp32) of queries ``qb`` ``[b, Hkv, g, D]`` against ``kb``."""
    s = torch.einsum("bhgd,khd->hgbk", qb, kb).mul_(scale)
    rows, keys = qb.shape[0], kb.shape[0]
    hidden = (
        torch.arange(keys, device=qb.device) > causal_offset + torch.arange(rows, device=qb.device)[:, None]
    )
    return s.masked_fill_(hidden, float("-inf"))


def _acc(x: Tensor) -> Tensor:
    """``x`` in the kernel's accumulation dtype: fp32, or the input's when wider."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """``[t, Hq, D]`` as ``[t, Hkv, g, D]`` (accumulation dtype): query heads grouped by their key head."""
    return _acc(x).unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def torch_forward(q: Tensor, k: Tensor, v: Tensor, pieces: Pieces, scale: float) -> tuple[Tensor, Tensor]:
    """Exact blocked forward on any device: ``(out [Tq, Hq, D] in q's dtype, lse [Hq, Tq])``.

    Computes in fp32 (float64 for float64 inputs); ``lse`` is kept in that precision.
    """
    kv_heads = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.zeros((q.shape[1], q.shape[0]), dtype=acc, device=q.device)
    for q0, q1, k0, k1, offset in _blocks(pieces, q.shape[1]):
        s = _scores(_grouped(q[q0:q1], kv_heads), _acc(k[k0:k1]), offset, scale)
        block_lse = torch.logsumexp(s, dim=-1)
        p = s.sub_(block_lse.unsqueeze(-1)).exp_()
        out[q0:q1] = torch.einsum("hgbk,khd->bhgd", p, _acc(v[k0:k1])).flatten(1, 2)
        lse[:, q0:q1] = block_lse.flatten(0, 1)
    return out.to(q.dtype), lse


def torch_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, pieces: Pieces, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact blocked backward recomputing each block's probabilities from ``lse``: ``(dq, dk, dv)``."""
    kv_heads = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for q0, q1, k0, k1, offset in _blocks(pieces, q.shape[1]):
        qb, kb, vb = _grouped(q[q0:q1], kv_heads), _acc(k[k0:k1]), _acc(v[k0:k1])
        dob = _grouped(dout[q0:q1], kv_heads)
        block_lse = lse[:, q0:q1].unflatten(0, (kv_heads, -1))
        p = _scores(qb, kb, offset, scale).sub_(block_lse.unsqueeze(-1)).exp_()
        dv[k0:k1] += torch.einsum("hgbk,bhgd->khd", p, dob)
        # D_i = sum_d dO_i * O_i: the softmax backward's row term.
        delta = (dob * _grouped(out[q0:q1], kv_heads)).sum(-1).permute(1, 2, 0)
        ds = p.mul_(torch.einsum("bhgd,khd->hgbk", dob, vb).sub_(delta.unsqueeze(-1))).mul_(scale)
        dq[q0:q1] = torch.einsum("hgbk,khd->bhgd", ds, kb).flatten(1, 2)
        dk[k0:k1] += torch.einsum("hgbk,bhgd->khd", ds, qb)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
