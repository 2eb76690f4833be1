"""The Triton kernels of the top-k sparse attention: one round of key/value heads, forward and backward.

The contract is :func:`lightning_cp.parallel.sparse_attention._torch_forward`'s and ``_torch_backward``'s (the
same arguments, the same results). Each program is one query token and a block of the query heads that read
one key/value head (MQA: up to :data:`HEAD_BLOCK` of every head), and loops over the token's selected keys in
tiles of :data:`KEY_TILE`, each tile's keys and values loaded by their rows (no gathered copy): an online
softmax in fp32 in the forward; in the backward the probabilities recomputed from the saved log-sum-exp,
``dq`` accumulated in the program and the keys' and values' gradients added atomically into the fp32 buffer
the reduce-scatter sums, at the keys' gathered rows (``order[row]``). With the values the keys' first
``value_dim`` columns, the values are read from the keys and their gradient added there.

Both are custom ops (``torch.ops.lightning_cp.sparse_forward_round``, ``sparse_backward_round``) with FLOP
formulas: a dispatch or FLOP counter sees one operator a round and its FLOPs, as a GPU runs them.

Products run in the inputs' dtype with fp32 accumulation (bf16 / fp16: the probabilities cast to it before
they multiply the values, as FlashAttention does); fp32 inputs in full fp32 (no TF32). Head dims are padded to
powers of two in registers. Tested in Triton's interpreter on CPU tensors
(``tests/parallel/_sparse_triton_cases.py``); the speed on a GPU is not measured here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch kernel runs instead (sparse_attention._kernels)
    triton = None

KEY_TILE = 32
"""Selected keys per tile of the loop of a program."""
HEAD_BLOCK = 32
"""Query heads per program at most (at least 16: ``tl.dot``'s smallest block; the spare rows are masked)."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Input dtypes the kernels take (float64 runs the torch kernel)."""


def available(x: Tensor) -> bool:
    """Triton is installed and takes ``x``'s dtype."""
    return triton is not None and x.dtype in DTYPES


@torch.library.custom_op("lightning_cp::sparse_forward_round", mutates_args=("out", "lse"))
def forward_round(
    q: Tensor,
    keys: Tensor,
    values: Tensor | None,
    value_dim: int,
    selected: Tensor,
    scale: float,
    out: Tensor,
    lse: Tensor,
) -> None:
    """``q`` ``[T, hq, D]`` over its ``selected`` ``[T, n]`` rows of ``keys`` ``[K, h, D]`` and ``values``
    ``[K, h, Dv]`` (``None``: ``keys[..., :value_dim]``), written to ``out`` ``[T, hq, Dv]`` and ``lse``
    ``[T, hq]`` (fp32). One launch of ``T x h x ceil(g / block)`` programs; no communication."""
    values = keys if values is None else values
    group, blocks = _head_blocks(q.shape[1], keys.shape[1])
    grid = (q.shape[0], keys.shape[1], blocks)
    _forward[grid](
        q, keys, values, selected, out, lse,
        *q.stride(), *keys.stride(), *values.stride(), *selected.stride(), *out.stride(), *lse.stride(),
        selected.shape[1], group, q.shape[2], value_dim, scale,
        **_constants(q, group, keys.shape[2], value_dim),
    )  # fmt: skip


@torch.library.custom_op("lightning_cp::sparse_backward_round", mutates_args=("dq", "key_grad", "value_grad"))
def backward_round(
    q: Tensor,
    keys: Tensor,
    values: Tensor | None,
    value_dim: int,
    selected: Tensor,
    order: Tensor,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    scale: float,
    dq: Tensor,
    key_grad: Tensor,
    value_grad: Tensor | None,
) -> None:
    """Writes ``dq`` ``[T, hq, D]`` and adds the keys' and values' gradients at rows ``order[row]`` of the fp32
    ``key_grad`` ``[K, h, D]`` and ``value_grad`` ``[K, h, Dv]`` (``None``: into ``key_grad[..., :value_dim]``),
    from ``dout`` ``[T, hq, Dv]``, the forward's ``lse`` and ``delta = rowsum(dout * out)`` (both ``[T, hq]``).
    One launch, as the forward's; no communication."""
    values = keys if values is None else values
    value_grad = key_grad if value_grad is None else value_grad
    group, blocks = _head_blocks(q.shape[1], keys.shape[1])
    grid = (q.shape[0], keys.shape[1], blocks)
    _backward[grid](
        q, keys, values, selected, order, dout, lse, delta, dq, key_grad, value_grad,
        *q.stride(), *keys.stride(), *values.stride(), *selected.stride(), *dout.stride(), *lse.stride(),
        *delta.stride(), *dq.stride(), *key_grad.stride(), *value_grad.stride(),
        selected.shape[1], group, q.shape[2], value_dim, scale,
        **_constants(q, group, keys.shape[2], value_dim),
    )  # fmt: skip


def _no_output(*_: object) -> None:
    """The rounds' fake: they write into their arguments only."""


forward_round.register_fake(_no_output)
backward_round.register_fake(_no_output)


def _round_flops(key_products: int, value_products: int) -> Callable[..., int]:
    """A round's FLOP formula: ``2 T Hq n (key_products D + value_products Dv)`` for ``q`` ``[T, Hq, D]``, ``n``
    selected keys a query and values of ``Dv`` (the shapes and arguments as the rounds take them)."""

    def flops(
        q: torch.Size,
        keys: torch.Size,
        _: object,
        value_dim: int,
        selected: torch.Size,
        *__: object,
        **___: object,
    ) -> int:
        return 2 * q[0] * q[1] * selected[1] * (key_products * keys[2] + value_products * value_dim)

    return flops


# Forward: the scores and the values. Backward: the scores again, dq and dk; dp and dv.
register_flop_formula(torch.ops.lightning_cp.sparse_forward_round)(_round_flops(1, 1))
register_flop_formula(torch.ops.lightning_cp.sparse_backward_round)(_round_flops(3, 2))


def _head_blocks(heads: int, kv_heads: int) -> tuple[int, int]:
    """The query heads of one key/value head and the programs that share them."""
    group = heads // kv_heads
    return group, -(-group // HEAD_BLOCK)


def _constants(q: Tensor, group: int, key_dim: int, value_dim: int) -> dict[str, object]:
    return {
        "BLOCK_H": max(16, min(HEAD_BLOCK, triton.next_power_of_2(group))),
        "BLOCK_N": KEY_TILE,
        "BLOCK_D": max(16, triton.next_power_of_2(key_dim)),
        "BLOCK_DV": max(16, triton.next_power_of_2(value_dim)),
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


if triton is not None:

    @triton.jit
    def _tile(
        keys, values, selected, token, kv_head, start, width,
        sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, ss_t, ss_n, key_dim, value_dim,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        """One tile of a token's selected keys ``[BLOCK_N, BLOCK_D]`` and values ``[BLOCK_N, BLOCK_DV]``
        (zeros where the selection is ``-1`` or past ``width``), their rows and where they are real."""
        n = start + tl.arange(0, BLOCK_N)
        rows = tl.load(selected + token * ss_t + n * ss_n, mask=n < width, other=-1).to(tl.int64)
        real = rows >= 0
        rows = tl.where(real, rows, 0)
        d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        k = tl.load(
            keys + rows[:, None] * sk_t + kv_head * sk_h + d[None, :] * sk_d,
            mask=real[:, None] & (d[None, :] < key_dim),
            other=0.0,
        )
        v = tl.load(
            values + rows[:, None] * sv_t + kv_head * sv_h + dv[None, :] * sv_d,
            mask=real[:, None] & (dv[None, :] < value_dim),
            other=0.0,
        )
        return k, v, rows, real

    @triton.jit
    def _forward(
        q, keys, values, selected, out, lse,
        sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, ss_t, ss_n, so_t, so_h, so_d, sl_t, sl_h,
        width, group, key_dim, value_dim, scale,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        token, kv_head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        local = block * BLOCK_H + tl.arange(0, BLOCK_H)
        head = kv_head * group + local
        live = local < group
        d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        queries = tl.load(
            q + token * sq_t + head[:, None] * sq_h + d[None, :] * sq_d,
            mask=live[:, None] & (d[None, :] < key_dim),
            other=0.0,
        )
        best = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
        for start in range(0, width, BLOCK_N):
            k, v, _, real = _tile(
                keys, values, selected, token, kv_head, start, width,
                sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, ss_t, ss_n, key_dim, value_dim,
                BLOCK_N, BLOCK_D, BLOCK_DV,
            )  # fmt: skip
            scores = tl.dot(queries, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(real[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            # A tile without a real key leaves the running values as they are (exp(-inf - -inf) is nan).
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)
            p = tl.exp(scores - shift[:, None])
            kept = tl.exp(best - shift)
            total = total * kept + tl.sum(p, 1)
            acc = acc * kept[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        tl.store(
            out + token * so_t + head[:, None] * so_h + dv[None, :] * so_d,
            (acc / total[:, None]).to(out.dtype.element_ty),
            mask=live[:, None] & (dv[None, :] < value_dim),
        )
        tl.store(lse + token * sl_t + head * sl_h, best + tl.log(total), mask=live)

    @triton.jit
    def _backward(
        q, keys, values, selected, order, dout, lse, delta, dq, key_grad, value_grad,
        sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, ss_t, ss_n, sdo_t, sdo_h, sdo_d,
        sl_t, sl_h, sde_t, sde_h, sdq_t, sdq_h, sdq_d, skg_t, skg_h, skg_d, svg_t, svg_h, svg_d,
        width, group, key_dim, value_dim, scale,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        token, kv_head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        local = block * BLOCK_H + tl.arange(0, BLOCK_H)
        head = kv_head * group + local
        live = local < group
        d, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        key_mask, value_mask = (
            live[:, None] & (d[None, :] < key_dim),
            live[:, None] & (dv[None, :] < value_dim),
        )
        queries = tl.load(
            q + token * sq_t + head[:, None] * sq_h + d[None, :] * sq_d, mask=key_mask, other=0.0
        )
        grad_out = tl.load(
            dout + token * sdo_t + head[:, None] * sdo_h + dv[None, :] * sdo_d, mask=value_mask, other=0.0
        )
        # Spare head rows: an lse of +inf makes their probabilities 0.
        row_lse = tl.load(lse + token * sl_t + head * sl_h, mask=live, other=float("inf"))
        row_delta = tl.load(delta + token * sde_t + head * sde_h, mask=live, other=0.0)
        grad_q = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        for start in range(0, width, BLOCK_N):
            k, v, rows, real = _tile(
                keys, values, selected, token, kv_head, start, width,
                sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, ss_t, ss_n, key_dim, value_dim,
                BLOCK_N, BLOCK_D, BLOCK_DV,
            )  # fmt: skip
            scores = tl.dot(queries, tl.trans(k), input_precision=PRECISION) * scale
            p = tl.where(real[None, :], tl.exp(scores - row_lse[:, None]), 0.0)
            dp = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - row_delta[:, None]) * scale
            grad_q += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
            at = tl.load(order + rows, mask=real, other=0)
            grad_k = tl.dot(tl.trans(ds.to(queries.dtype)), queries, input_precision=PRECISION)
            tl.atomic_add(
                key_grad + at[:, None] * skg_t + kv_head * skg_h + d[None, :] * skg_d,
                grad_k,
                mask=real[:, None] & (d[None, :] < key_dim),
            )
            grad_v = tl.dot(tl.trans(p.to(grad_out.dtype)), grad_out, input_precision=PRECISION)
            tl.atomic_add(
                value_grad + at[:, None] * svg_t + kv_head * svg_h + dv[None, :] * svg_d,
                grad_v,
                mask=real[:, None] & (dv[None, :] < value_dim),
            )
        tl.store(
            dq + token * sdq_t + head[:, None] * sdq_h + d[None, :] * sdq_d,
            grad_q.to(dq.dtype.element_ty),
            mask=key_mask,
        )
