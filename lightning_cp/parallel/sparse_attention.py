"""Attention of each query over the keys its indexer selected, over whole sequences while each rank holds its shard.

The sparse attention of DeepSeek Sparse Attention models reads, for every query, only the keys a lightning
indexer selected (:func:`~lightning_cp.parallel.key_indexer.select_topk_keys`, rows in sequence order). Under
context parallelism the selected keys lie on every rank: :func:`sparse_attention` all-gathers the keys and
values (in rounds of key/value heads, as the dense all-gather does:
:meth:`AttentionMode.heads_per_gather <lightning_cp.parallel.attention_mode.AttentionMode.heads_per_gather>`),
puts them in sequence order, and for a bounded block of queries at a time gathers each query's selected keys
and values and attends to exactly those (an exact softmax over at most ``topk`` keys, in fp32 or wider). The backward
gathers the keys and values again, recomputes each block's probabilities from the saved log-sum-exp, adds the
selected keys' gradients at their gathered rows of an fp32 buffer and reduce-scatters it back to their owners: a layer
saves ``O(T_local * topk)`` integers (the selection) and ``O(T_local)`` activations, never a block's gathered
keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_cp.parallel import _varlen
from lightning_cp.parallel._allgather_attention import head_rounds, token_major
from lightning_cp.parallel.attention_mode import gathered_bytes_per_head
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.shard import CPShard

SELECTED_BLOCK_BYTES = 64 * 2**20
"""Bytes of one block's selected keys and values (fp32, one round's heads): the bound on the working memory of
the attention besides the gathered keys and values of a round."""


def query_block_tokens(width: int, kv_heads: int, dims: int) -> int:
    """Queries per block of the attention: their ``width`` selected keys and values, ``kv_heads`` heads of
    ``dims`` dims together (``D + Dv``) in fp32, within :data:`SELECTED_BLOCK_BYTES` (at least 1). Read when
    called, so the memory plan (:mod:`lightning_cp.plan.sparse`) counts the blocks this module runs."""
    return max(1, SELECTED_BLOCK_BYTES // max(1, 4 * width * kv_heads * dims))


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    selected: Tensor,
    shard: CPShard,
    scale: float,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of this rank's queries over the keys ``selected`` for each, gathered from every CP rank.

    Args:
        q: ``[B, Hq, S_local, D]``, this rank's queries (rotary embedding applied).
        k: ``[B, Hkv, S_local, D]`` with ``Hkv`` dividing ``Hq``.
        v: ``[B, Hkv, S_local, Dv]`` (``Dv`` may differ from ``D``: multi-head latent attention).
        selected: ``[B * S_local, n]`` integers, each query's keys as rows in sequence order, ``-1`` for none
            (:func:`~lightning_cp.parallel.key_indexer.select_topk_keys`); every query has at least one. Kept
            for the backward as given (int32 takes half the memory of int64).
        shard: the batch's :class:`~lightning_cp.parallel.CPShard`.
        scale: softmax scale.
        sinks: ``[Hq]`` attention sinks (one logit per query head in every softmax denominator, without a
            value: HY-V4's ``s_aux``), differentiable; ``None`` for none.

    Returns:
        ``[B, Hq, S_local, Dv]`` in ``q``'s dtype (computed in fp32, or float64 for float64 inputs).

    Communication: per round of key/value heads, one all-gather of K and V over the shard's CP group in the
    forward; in the backward the same again and one reduce-scatter (NCCL) or all-reduce (gloo) of their fp32
    gradients. None without CP.
    """
    batch, heads, local_len, _ = q.shape
    if batch * local_len == 0:
        return q.new_empty((batch, heads, local_len, v.shape[-1]))
    order = shard.sequence_order()
    per_head = gathered_bytes_per_head(order.numel(), k.shape[-1], v.shape[-1], k.element_size())
    per_round = shard.attention.heads_per_gather(k.shape[1], per_head, shard.kv_gather_budget)
    out = _SparseAttention.apply(
        token_major(q),
        token_major(k),
        token_major(v),
        sinks,
        selected,
        order,
        shard.group_exchange(),
        scale,
        per_round,
    )
    return out.view(batch, local_len, heads, v.shape[-1]).transpose(1, 2)


class _SparseAttention(torch.autograd.Function):
    """Token-major ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` and optional ``sinks [Hq]`` ->
    ``[T, Hq, Dv]``: each query over its ``selected`` rows of the keys gathered through ``exchange`` and put in
    sequence order by ``order``, ``per_round`` key/value heads at a time. Saves the local tensors, the
    selection and the log-sum-exp only."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        selected: Tensor,
        order: Tensor,
        exchange: GroupExchange,
        scale: float,
        per_round: int,
    ) -> Tensor:
        out = q.new_empty((*q.shape[:2], v.shape[-1]))
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_accumulation(q))
        for kv_heads, q_heads in head_rounds(k.shape[1], q.shape[1], per_round):
            keys, values = _gathered(k[:, kv_heads], v[:, kv_heads], order, exchange)
            for block in _blocks(selected.shape, keys.shape[1], keys.shape[2] + values.shape[2]):
                rows, valid = _rows(selected[block])
                queries = _grouped(q[block, q_heads], keys.shape[1])
                probabilities, block_lse = _probabilities(queries, _up(keys[rows]), valid, scale)
                block_out = torch.einsum("bhgn,bnhd->bhgd", probabilities, _up(values[rows]))
                out[block, q_heads] = block_out.flatten(1, 2).to(out.dtype)
                lse[q_heads, block] = block_lse.flatten(1, 2).T
                del probabilities, block_out  # this block's, before the next block's are made
            del keys, values
        if sinks is not None:
            out, lse = _varlen.add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, sinks, selected, order, out, lse)
        ctx.exchange, ctx.scale, ctx.per_round = exchange, scale, per_round
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, sinks, selected, order, out, lse = ctx.saved_tensors
        scale = ctx.scale
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # delta = rowsum(dout * out): the softmax backward's correction, per query and head (a sink, which has
        # no value, enters only through it and through the log-sum-exp).
        delta = (_up(dout) * _up(out)).sum(-1)
        for kv_heads, q_heads in head_rounds(k.shape[1], q.shape[1], ctx.per_round):
            keys, values = _gathered(k[:, kv_heads], v[:, kv_heads], order, ctx.exchange)
            group = keys.shape[1]
            # The gradients are added at the keys' gathered rows of the buffer the reduce-scatter sums, so a
            # round holds its keys and values and one fp32 copy of them, never a sequence-order one beside it.
            split = group * keys.shape[2]
            full = keys.new_zeros((order.numel(), split + group * values.shape[2]), dtype=_accumulation(keys))
            key_grad = full[:, :split].unflatten(1, keys.shape[1:])
            value_grad = full[:, split:].unflatten(1, values.shape[1:])
            for block in _blocks(selected.shape, group, keys.shape[2] + values.shape[2]):
                rows, valid = _rows(selected[block])
                at = order[rows.flatten()]  # the selected keys' rows in the gathered buffer
                queries = _grouped(q[block, q_heads], group)
                block_keys, block_values = _up(keys[rows]), _up(values[rows])
                probabilities, _ = _probabilities(queries, block_keys, valid, scale, lse[q_heads, block].T)
                block_dout = _grouped(dout[block, q_heads], group)
                value_grad.index_add_(
                    0, at, torch.einsum("bhgn,bhgd->bnhd", probabilities, block_dout).flatten(0, 1)
                )
                dp = torch.einsum("bhgd,bnhd->bhgn", block_dout, block_values)
                ds = probabilities * (dp - _grouped(delta[block, q_heads], group).unsqueeze(-1)) * scale
                dq[block, q_heads] = (
                    torch.einsum("bhgn,bnhd->bhgd", ds, block_keys).flatten(1, 2).to(dq.dtype)
                )
                key_grad.index_add_(0, at, torch.einsum("bhgn,bhgd->bnhd", ds, queries).flatten(0, 1))
                del block_keys, block_values, probabilities, dp, ds  # before the next block's are made
            del keys, values, key_grad, value_grad
            local = ctx.exchange.reduce_scatter(full)
            del full
            dk[:, kv_heads] = local[:, :split].unflatten(1, (-1, k.shape[2])).to(dk.dtype)
            dv[:, kv_heads] = local[:, split:].unflatten(1, (-1, v.shape[2])).to(dv.dtype)
        dsinks = _varlen.sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None


def _rows(selected: Tensor) -> tuple[Tensor, Tensor]:
    """A block's selected rows ``[b, n]`` as an int64 index (``-1`` read as row 0) and where they are real."""
    return selected.clamp(min=0).long(), selected >= 0


def _gathered(k: Tensor, v: Tensor, order: Tensor, exchange: GroupExchange) -> tuple[Tensor, Tensor]:
    """Every rank's keys ``[K, h, D]`` and values ``[K, h, Dv]`` in sequence order (one all-gather of both)."""
    kv = exchange.all_gather(torch.cat([k.flatten(1), v.flatten(1)], dim=1)).index_select(0, order)
    split = k.shape[1] * k.shape[2]
    return kv[:, :split].unflatten(1, k.shape[1:]), kv[:, split:].unflatten(1, v.shape[1:])


def _accumulation(x: Tensor) -> torch.dtype:
    """fp32, or ``x``'s dtype where wider (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def _up(x: Tensor) -> Tensor:
    """``x`` in its accumulation dtype (:func:`_accumulation`)."""
    return x.to(_accumulation(x))


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """``[b, Hq_round, d]`` -> ``[b, h, g, d]`` in the accumulation dtype: query head ``i`` reads key/value head
    ``i // g``."""
    return _up(x.unflatten(1, (kv_heads, -1)))


def _probabilities(
    queries: Tensor, keys: Tensor, valid: Tensor, scale: float, lse: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Softmax ``[b, h, g, n]`` of ``queries`` ``[b, h, g, D]`` over their selected ``keys`` ``[b, n, h, D]``
    (``valid`` ``[b, n]``), and its log-sum-exp ``[b, h, g]``; from a saved ``lse`` (``[b, Hq_round]``, a sink's
    share included) when given."""
    scores = torch.einsum("bhgd,bnhd->bhgn", queries, keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    else:
        lse = lse.reshape(scores.shape[:3])
    return torch.exp(scores - lse.unsqueeze(-1)), lse


def _blocks(selected_shape: torch.Size, kv_heads: int, dims: int) -> list[slice]:
    """Query blocks whose selected keys and values (``kv_heads`` heads of ``dims`` dims together, fp32) take at
    most :data:`SELECTED_BLOCK_BYTES` (:func:`query_block_tokens`)."""
    tokens, width = selected_shape
    size = query_block_tokens(width, kv_heads, dims)
    return [slice(start, min(start + size, tokens)) for start in range(0, tokens, size)]
