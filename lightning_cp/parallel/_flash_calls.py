"""FlashAttention-2 over the calls of a :class:`~lightning_cp.parallel._key_selection.KeySelection`.

One rank's query pieces and the keys they read (in sequence order) become a few calls of PyTorch's
variable-length FlashAttention-2 kernels (:mod:`lightning_cp.parallel._varlen`), one per kept chunk under CP:
each call reads its queries and keys in place where they lie back to back, else copies only its rows. The
forward writes every call's output and log-sum-exp into this rank's ``[T_local]`` rows; the backward sums
the calls' key and value gradients in fp32 (the kernels' accumulation dtype), under CP straight into the
rank-major buffer that the reduce-scatter sums over the ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_cp.parallel import _varlen
from lightning_cp.parallel._key_selection import KeySelection, Rows

Rng = tuple[Tensor, Tensor]
"""A forward call's random-number state, which its backward takes back."""


def forward(
    q: Tensor, k: Tensor, v: Tensor, keys: KeySelection, scale: float
) -> tuple[Tensor, Tensor, list[Rng]]:
    """FlashAttention-2 varlen over ``keys.calls``: ``(out [T_local, Hq, Dv], lse [Hq, T_local], rng per call)``.

    ``k`` ``[K, Hkv, D]`` and ``v`` ``[K, Hkv, Dv]`` are the keys in sequence order.
    """
    out = q.new_empty((*q.shape[:2], v.shape[-1]))
    # FlashAttention-2's log-sum-exp is fp32 for its fp16 / bf16 inputs (the accumulation dtype).
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.promote_types(q.dtype, torch.float32))
    rngs = []
    for call in keys.calls:
        call_out, call_lse, rng = _varlen.flash_forward(
            _take(q, call.queries),
            _take(k, call.keys),
            _take(v, call.keys),
            call.cu_queries,
            call.cu_keys,
            call.max_queries,
            call.max_keys,
            scale,
            window=keys.window,
        )
        _put(out, call.queries, call_out)
        _put(lse.T, call.queries, call_lse.T)
        rngs.append(rng)
    return out, lse, rngs


def backward(
    dout: Tensor,
    q: Tensor,
    ordered_keys: Callable[[], tuple[Tensor, Tensor]],
    out: Tensor,
    lse: Tensor,
    keys: KeySelection,
    scale: float,
    rngs: list[Rng],
    dk: Tensor,
    dv: Tensor,
) -> Tensor:
    """``dq`` of :func:`forward`; the calls' key and value gradients are added into ``dk``, ``dv`` (fp32: a
    bf16 sum would round at every call), at the rows ``keys.order`` gives the keys in sequence order (the
    rank-major buffer the reduce-scatter sums), or, without an order, at the keys' own rows ``[K]``.

    ``ordered_keys()`` gives the keys and values in sequence order (gathered again under CP); they are
    released before the last call when it reads a copy of its rows.
    """
    k, v = ordered_keys()
    dq = torch.empty_like(q)
    calls = list(zip(keys.calls, rngs, strict=True))
    for position, (call, rng) in enumerate(calls):
        call_k, call_v = _take(k, call.keys), _take(v, call.keys)
        if position == len(calls) - 1:
            del k, v  # the last call holds its own rows (or views of them): let the rest go
        grads = _varlen.flash_backward(
            _take(dout, call.queries),
            _take(q, call.queries),
            call_k,
            call_v,
            _take(out, call.queries),
            _take(lse.T, call.queries).T.contiguous(),
            call.cu_queries,
            call.cu_keys,
            call.max_queries,
            call.max_keys,
            scale,
            rng,
            window=keys.window,
        )
        del call_k, call_v
        _put(dq, call.queries, grads[0])
        rows = call.keys if keys.order is None else _take(keys.order, call.keys)
        _add(dk, rows, grads[1])
        _add(dv, rows, grads[2])
    return dq


def _take(x: Tensor, rows: Rows) -> Tensor:
    """``x[rows]`` along dim 0: a view for a slice, a copy for an index."""
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put(out: Tensor, rows: Rows, value: Tensor) -> None:
    """``out[rows] = value`` along dim 0."""
    if isinstance(rows, slice):
        out[rows] = value
    else:
        out.index_copy_(0, rows, value)


def _add(out: Tensor, rows: Rows, value: Tensor) -> None:
    """``out[rows] += value`` along dim 0 (rows distinct), in ``out``'s dtype."""
    if isinstance(rows, slice):
        out[rows] += value
    else:
        out.index_add_(0, rows, value.to(out.dtype))
