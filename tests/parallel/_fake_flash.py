"""A CPU stand-in for PyTorch's FlashAttention-2 varlen ops, to run CP attention's CUDA path on the CPU.

:func:`fake_flash` replaces ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward``
(the attributes ``lightning_cp.parallel._varlen`` calls) by an eager softmax per piece with FlashAttention-2's
semantics (bottom-right causal alignment, ``window_size_left``, grouped-query heads, the ``[H, total_q]``
log-sum-exp), and makes :func:`~lightning_cp.parallel._varlen.use_flash` choose it for any input without
softcapping. It checks what the real kernels require of their arguments (one head dim for q, k, v; a unit
last stride; int32 boundaries that cover exactly the rows given; a contiguous log-sum-exp; maxima at least
the longest piece), so the call bookkeeping of ``attention.py`` runs and is checked on the CPU. The
backward is FlashAttention-2's: probabilities from the log-sum-exp it is given, ``rowsum(dO * O)`` from
the output it is given. The arithmetic is eager and exact, not FlashAttention's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_cp.parallel import _varlen

CALLS: list[dict[str, int]] = []
"""Every forward call since :func:`fake_flash` was entered: its query rows, key rows and pieces."""


def _check(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int) -> None:
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FlashAttention-2 takes one head dim for q, k, v"
    assert all(t.stride(-1) == 1 for t in (q, k, v)), "FlashAttention-2 needs a unit last stride"
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.is_contiguous() and cu_k.is_contiguous()
    assert len(cu_q) == len(cu_k) and int(cu_q[0]) == int(cu_k[0]) == 0
    assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0] == v.shape[0]
    assert int(cu_q.diff().max()) <= max_q and int(cu_k.diff().max()) <= max_k
    assert bool((cu_q.diff() <= cu_k.diff()).all()), "bottom-right alignment needs lq <= lk per piece"


def _pieces(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float, left: int | None):
    """Per piece: its query and key rows and its masked scores ``[Hq, lq, lk]`` (keys repeated per group)."""
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1].repeat_interleave(group, 1)) * scale
        diagonal = (k1 - k0) - (q1 - q0) + torch.arange(q1 - q0)[:, None]
        key = torch.arange(k1 - k0)[None]
        hidden = key > diagonal
        if left is not None:
            hidden |= key < diagonal - left
        yield slice(q0, q1), slice(k0, k1), scores.masked_fill(hidden, float("-inf"))


def _attend(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float, left: int | None):
    """``(out [Tq, Hq, Dv], lse [Hq, Tq])`` in the accumulation dtype."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for _, keys, scores in _pieces(q, k, cu_q, cu_k, scale, left):
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[keys].repeat_interleave(group, 1)))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _acc(x: Tensor) -> Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _forward(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout,
    causal,
    debug,
    *,
    scale,
    window_size_left=None,
    window_size_right=None,
):
    _check(q, k, v, cu_q, cu_k, max_q, max_k)
    assert dropout == 0.0 and causal and not debug and window_size_right in (None, 0)
    CALLS.append({"queries": q.shape[0], "keys": k.shape[0], "pieces": len(cu_q) - 1})
    with torch.no_grad():
        out, lse = _attend(_acc(q), _acc(k), _acc(v), cu_q, cu_k, scale, window_size_left)
    rng = (torch.zeros(2, dtype=torch.int64), torch.empty(0))
    return out.to(q.dtype), lse, *rng, torch.empty(0)


def _backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout,
    causal,
    rng_state,
    unused,
    *,
    scale,
    window_size_left=None,
    window_size_right=None,
):
    _check(q, k, v, cu_q, cu_k, max_q, max_k)
    assert dout.shape == out.shape == q.shape and dout.stride(-1) == out.stride(-1) == 1
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous(), (
        "lse must be [H, total_q], contiguous"
    )
    # FlashAttention-2's backward: the probabilities from the given log-sum-exp, rowsum(dO * O) from the
    # given output (so a correction of both, as attention sinks make, carries into the gradients).
    dtype = q.dtype
    q, k, v, dout, out, lse = (_acc(t) for t in (q, k, v, dout, out, lse))
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * out).sum(-1).T  # [Hq, Tq]
    for queries, keys, scores in _pieces(q, k, cu_q, cu_k, scale, window_size_left):
        p = torch.exp(scores - lse[:, queries, None])
        vs, ks = v[keys].repeat_interleave(group, 1), k[keys].repeat_interleave(group, 1)
        dp = torch.einsum("qhd,khd->hqk", dout[queries], vs)
        ds = p * (dp - delta[:, queries, None]) * scale
        dq[queries] = torch.einsum("hqk,khd->qhd", ds, ks)
        dk[keys] += torch.einsum("hqk,qhd->khd", ds, q[queries]).unflatten(1, (k.shape[1], group)).sum(2)
        dv[keys] += torch.einsum("hqk,qhd->khd", p, dout[queries]).unflatten(1, (k.shape[1], group)).sum(2)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


_FAKES = {"_flash_attention_forward": _forward, "_flash_attention_backward": _backward}


@contextlib.contextmanager
def fake_flash() -> Iterator[list[dict[str, int]]]:
    """Within: CP attention takes its FlashAttention-2 path on any device, through the fake kernels; yields
    :data:`CALLS` (cleared on entry)."""
    aten, use_flash = torch.ops.aten, _varlen.use_flash
    real = {name: getattr(aten, name) for name in _FAKES}
    CALLS.clear()
    for name, fake in _FAKES.items():
        setattr(aten, name, fake)
    _varlen.use_flash = lambda q, k, v, softcap: softcap is None
    try:
        yield CALLS
    finally:
        for name, op in real.items():
            setattr(aten, name, op)
        _varlen.use_flash = use_flash
