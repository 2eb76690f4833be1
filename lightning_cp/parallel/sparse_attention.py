"""Attention of each query over the keys its indexer selected, over whole sequences while each rank holds its shard.

The sparse attention of DeepSeek Sparse Attention models reads, for every query, only the keys a lightning
indexer selected (:func:`~lightning_cp.parallel.key_indexer.select_topk_keys`, rows in sequence order). Under
context parallelism the selected keys lie on every rank: :func:`sparse_attention` all-gathers the keys and
values (in rounds of key/value heads, as the dense all-gather does:
:meth:`AttentionMode.heads_per_gather <lightning_cp.parallel.attention_mode.AttentionMode.heads_per_gather>`),
puts them in sequence order, and attends each query to exactly its selected keys (an exact softmax over at most
``topk`` keys, in fp32 or wider). Multi-head latent attention in its absorbed (MQA) form passes one latent key
per token shared by every query head, whose first ``value_dim`` columns are the values (``v=None``): only the
keys are gathered, and their gradient carries the values'.

Two kernels compute a round, with one contract (:func:`_torch_forward`, :func:`_torch_backward`; the Triton ones
in :mod:`lightning_cp.parallel._sparse_triton`): CUDA tensors take Triton (each program one query token and the
query heads of one key/value head, over the selected keys in tiles loaded by index, the keys' and values'
gradients added atomically into fp32 buffers); CPU tensors, and CUDA without Triton, take the torch kernel,
which works on blocks of at least :data:`MIN_BLOCK_QUERIES` queries and the query heads of some key/value heads
(:func:`query_block`): each block gathers its queries' selected keys once for all of those query heads (MQA:
every head), so the operators per layer grow with the blocks, not with the queries.

The backward gathers the keys and values again, recomputes the probabilities from the saved log-sum-exp, adds
the selected keys' gradients at their gathered rows of an fp32 buffer and reduce-scatters it back to their
owners: a layer saves ``O(T_local * topk)`` integers (the selection) and ``O(T_local)`` activations, never a
block's gathered keys.
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

SELECTED_BLOCK_BYTES = 512 * 2**20
"""Bytes of one torch-kernel block's fp32 selected keys (and values) and scores: the bound on the working
memory of the attention besides the gathered keys and values of a round, unless a block of
:data:`MIN_BLOCK_QUERIES` queries and one key/value head alone exceeds it."""

MIN_BLOCK_QUERIES = 64
"""The fewest queries a torch-kernel block holds (fewer only at the end of the tokens): the bound on the
operators per layer, which grow with the blocks."""


def query_block(width: int, kv_heads: int, group: int, dims: int) -> tuple[int, int]:
    """Queries and key/value heads of one block of the torch kernel.

    A block holds, for each of its queries and key/value heads, the ``width`` selected keys (and values) of
    ``dims`` columns together (``D + Dv``; ``D`` when the values are the keys' columns) and the scores of the
    ``group`` query heads that read the head, in fp32: as many queries as fit :data:`SELECTED_BLOCK_BYTES` with
    all ``kv_heads`` (at least :data:`MIN_BLOCK_QUERIES`), then as many of the heads as fit beside them (at
    least one). Read when called, so the memory plan (:mod:`lightning_cp.plan.sparse`) counts the blocks this
    module runs.
    """
    per_query_head = 4 * width * (dims + group)
    queries = max(MIN_BLOCK_QUERIES, SELECTED_BLOCK_BYTES // max(1, per_query_head * kv_heads))
    heads = min(kv_heads, max(1, SELECTED_BLOCK_BYTES // max(1, per_query_head * queries)))
    return queries, heads


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    selected: Tensor,
    shard: CPShard,
    scale: float,
    sinks: Tensor | None = None,
    *,
    value_dim: int | None = None,
) -> Tensor:
    """Attention of this rank's queries over the keys ``selected`` for each, gathered from every CP rank.

    Args:
        q: ``[B, Hq, S_local, D]``, this rank's queries (rotary embedding applied).
        k: ``[B, Hkv, S_local, D]`` with ``Hkv`` dividing ``Hq``.
        v: ``[B, Hkv, S_local, Dv]`` (``Dv`` may differ from ``D``: multi-head latent attention), or ``None``
            for values that are the keys' first ``value_dim`` columns (MLA's absorbed form: one latent of
            ``kv_lora_rank + qk_rope_head_dim`` per token, ``Hkv = 1``, read by every query head).
        selected: ``[B * S_local, n]`` integers, each query's keys as rows in sequence order, ``-1`` for none
            (:func:`~lightning_cp.parallel.key_indexer.select_topk_keys`); every query has at least one. Kept
            for the backward as given (int32 takes half the memory of int64).
        shard: the batch's :class:`~lightning_cp.parallel.CPShard`.
        scale: softmax scale.
        sinks: ``[Hq]`` attention sinks (one logit per query head in every softmax denominator, without a
            value: HY-V4's ``s_aux``), differentiable; ``None`` for none.
        value_dim: with ``v=None``, the values' width ``Dv <= D``; ``None`` when ``v`` is given.

    Returns:
        ``[B, Hq, S_local, Dv]`` in ``q``'s dtype (computed in fp32, or float64 for float64 inputs). With
        ``v=None``, ``k``'s gradient includes the values'.

    Communication: per round of key/value heads, one all-gather of K and V (K alone with ``v=None``) over the
    shard's CP group in the forward; in the backward the same again and one reduce-scatter (NCCL) or
    all-reduce (gloo) of their fp32 gradients. None without CP.

    Raises:
        ValueError: ``v`` and ``value_dim`` both given or both missing, or ``value_dim`` not in ``1..D``.
    """
    _check_values(k, v, value_dim)
    out_dim = v.shape[-1] if v is not None else value_dim
    batch, heads, local_len, _ = q.shape
    if batch * local_len == 0:
        return q.new_empty((batch, heads, local_len, out_dim))
    order = shard.sequence_order()
    per_head = gathered_bytes_per_head(
        order.numel(), k.shape[-1], 0 if v is None else v.shape[-1], k.element_size()
    )
    per_round = shard.attention.heads_per_gather(k.shape[1], per_head, shard.kv_gather_budget)
    out = _SparseAttention.apply(
        token_major(q),
        token_major(k),
        None if v is None else token_major(v),
        sinks,
        selected,
        order,
        shard.group_exchange(),
        scale,
        per_round,
        out_dim,
    )
    return out.view(batch, local_len, heads, out_dim).transpose(1, 2)


def _check_values(k: Tensor, v: Tensor | None, value_dim: int | None) -> None:
    """The values are ``v`` or the keys' first ``value_dim`` columns, exactly one of the two."""
    if (v is None) == (value_dim is None):
        raise ValueError(
            f"sparse_attention: pass the values as v, or v=None with value_dim (the keys' first value_dim columns "
            f"are the values); got v={'None' if v is None else tuple(v.shape)} and value_dim={value_dim}."
        )
    if value_dim is not None and not 0 < value_dim <= k.shape[-1]:
        raise ValueError(
            f"sparse_attention: value_dim={value_dim} must be in 1..{k.shape[-1]} (the keys' width), the keys' "
            "columns that are the values."
        )


class _SparseAttention(torch.autograd.Function):
    """Token-major ``q [T, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` (or ``None``: ``k[..., :value_dim]``)
    and optional ``sinks [Hq]`` -> ``[T, Hq, Dv]``: each query over its ``selected`` rows of the keys gathered
    through ``exchange`` and put in sequence order by ``order``, ``per_round`` key/value heads at a time. Saves
    the local tensors, the selection and the log-sum-exp only."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor | None,
        sinks: Tensor | None,
        selected: Tensor,
        order: Tensor,
        exchange: GroupExchange,
        scale: float,
        per_round: int,
        value_dim: int,
    ) -> Tensor:
        out = q.new_empty((*q.shape[:2], value_dim))
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_accumulation(q))
        kernel_forward, _ = _kernels(q)
        for kv_heads, q_heads in head_rounds(k.shape[1], q.shape[1], per_round):
            keys, values = _gathered(k[:, kv_heads], _heads(v, kv_heads), order, exchange)
            kernel_forward(
                q[:, q_heads], keys, values, value_dim, selected, scale, out[:, q_heads], lse[q_heads].T
            )
            del keys, values
        if sinks is not None:
            out, lse = _varlen.add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, sinks, selected, order, out, lse)
        ctx.exchange, ctx.scale, ctx.per_round, ctx.value_dim = exchange, scale, per_round, value_dim
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, sinks, selected, order, out, lse = ctx.saved_tensors
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        dv = None if v is None else torch.empty_like(v)
        # delta = rowsum(dout * out): the softmax backward's correction, per query and head (a sink, which has
        # no value, enters only through it and through the log-sum-exp).
        delta = (_up(dout) * _up(out)).sum(-1)
        _, kernel_backward = _kernels(q)
        for kv_heads, q_heads in head_rounds(k.shape[1], q.shape[1], ctx.per_round):
            keys, values = _gathered(k[:, kv_heads], _heads(v, kv_heads), order, ctx.exchange)
            # The gradients are added at the keys' gathered rows of the buffer the reduce-scatter sums, so a
            # round holds its keys and values and one fp32 copy of them, never a sequence-order one beside it.
            split = keys.shape[1] * keys.shape[2]
            width = split + (0 if values is None else values.shape[1] * values.shape[2])
            full = keys.new_zeros((order.numel(), width), dtype=_accumulation(keys))
            key_grad = full[:, :split].unflatten(1, keys.shape[1:])
            value_grad = None if values is None else full[:, split:].unflatten(1, values.shape[1:])
            kernel_backward(
                q[:, q_heads],
                keys,
                values,
                ctx.value_dim,
                selected,
                order,
                dout[:, q_heads],
                lse[q_heads].T,
                delta[:, q_heads],
                ctx.scale,
                dq[:, q_heads],
                key_grad,
                value_grad,
            )
            del keys, values, key_grad, value_grad
            local = ctx.exchange.reduce_scatter(full)
            del full
            dk[:, kv_heads] = local[:, :split].unflatten(1, (-1, k.shape[2])).to(dk.dtype)
            if dv is not None:
                dv[:, kv_heads] = local[:, split:].unflatten(1, (-1, v.shape[2])).to(dv.dtype)
        dsinks = _varlen.sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None, None


def _kernels(q: Tensor) -> tuple[Any, Any]:
    """The round kernels ``(forward, backward)`` for ``q``: Triton's on CUDA when it is installed and takes
    ``q``'s dtype, else the torch kernel's."""
    if q.is_cuda:
        from lightning_cp.parallel import _sparse_triton

        if _sparse_triton.available(q):
            return _sparse_triton.forward_round, _sparse_triton.backward_round
    return _torch_forward, _torch_backward


def _heads(v: Tensor | None, heads: slice) -> Tensor | None:
    """``v[:, heads]``, or ``None`` when the keys hold the values."""
    return None if v is None else v[:, heads]


def _gathered(
    k: Tensor, v: Tensor | None, order: Tensor, exchange: GroupExchange
) -> tuple[Tensor, Tensor | None]:
    """Every rank's keys ``[K, h, D]`` and values ``[K, h, Dv]`` (``None`` when the keys hold them) in sequence
    order (one all-gather of both)."""
    if v is None:
        return exchange.all_gather(k.contiguous()).index_select(0, order), None
    kv = exchange.all_gather(torch.cat([k.flatten(1), v.flatten(1)], dim=1)).index_select(0, order)
    split = k.shape[1] * k.shape[2]
    return kv[:, :split].unflatten(1, k.shape[1:]), kv[:, split:].unflatten(1, v.shape[1:])


def _torch_forward(
    q: Tensor,
    keys: Tensor,
    values: Tensor | None,
    value_dim: int,
    selected: Tensor,
    scale: float,
    out: Tensor,
    lse: Tensor,
) -> None:
    """One round's forward in blocks (:func:`_blocks`): ``q`` ``[T, hq, D]`` over its ``selected`` ``[T, n]``
    rows of ``keys`` ``[K, h, D]`` and ``values`` ``[K, h, Dv]`` (``None``: ``keys[..., :value_dim]``), written
    to ``out`` ``[T, hq, Dv]`` and the log-sum-exp ``lse`` ``[T, hq]``."""
    for tokens, heads, q_heads in _blocks(selected.shape, keys.shape[1], q.shape[1], keys, values):
        kv_heads = heads.stop - heads.start
        _, block_keys, block_values, invalid = _selected(keys, values, value_dim, selected[tokens], heads)
        queries = _grouped(q[tokens, q_heads], kv_heads)
        probabilities, block_lse = _probabilities(queries, block_keys, invalid, scale)
        del block_keys  # before the output is made (with the values a view of them, the storage stays)
        out[tokens, q_heads] = _ungrouped(torch.bmm(probabilities, block_values), kv_heads)
        lse[tokens, q_heads] = _ungrouped(block_lse, kv_heads).squeeze(-1)
        del probabilities, block_values  # this block's, before the next block's are made


def _torch_backward(
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
    """One round's backward in the forward's blocks: writes ``dq`` ``[T, hq, D]`` and adds the keys' and values'
    gradients at their gathered rows (``order[row]``) of the fp32 ``key_grad`` ``[K, h, D]`` and ``value_grad``
    ``[K, h, Dv]`` (``None``: the values' go to ``key_grad[..., :value_dim]``); ``lse`` and ``delta``, both
    ``[T, hq]``, are the forward's log-sum-exp and ``rowsum(dout * out)``."""
    for tokens, heads, q_heads in _blocks(selected.shape, keys.shape[1], q.shape[1], keys, values):
        kv_heads = heads.stop - heads.start
        rows, block_keys, block_values, invalid = _selected(keys, values, value_dim, selected[tokens], heads)
        at = order[rows.flatten()]  # the selected keys' rows in the gathered buffer
        queries, block_dout = (
            _grouped(q[tokens, q_heads], kv_heads),
            _grouped(dout[tokens, q_heads], kv_heads),
        )
        block_lse = _grouped(lse[tokens, q_heads, None], kv_heads)
        probabilities, _ = _probabilities(queries, block_keys, invalid, scale, block_lse)
        values_grad = torch.bmm(probabilities.transpose(1, 2), block_dout)  # [h b, n, Dv]
        if value_grad is not None:
            _add_at(value_grad[:, heads], at, values_grad)
            del values_grad
        # ds = p * (dp - delta) * scale, made in dp's storage.
        ds = torch.bmm(block_dout, block_values.transpose(1, 2))
        del block_values
        ds.sub_(_grouped(delta[tokens, q_heads, None], kv_heads)).mul_(probabilities).mul_(scale)
        del probabilities
        dq[tokens, q_heads] = _ungrouped(torch.bmm(ds, block_keys), kv_heads)
        del block_keys
        keys_grad = torch.bmm(ds.transpose(1, 2), queries)  # [h b, n, D]
        if value_grad is None:
            keys_grad[..., :value_dim] += values_grad
            del values_grad
        _add_at(key_grad[:, heads], at, keys_grad)
        del ds, keys_grad  # before the next block's are made


def _add_at(buffer: Tensor, at: Tensor, grad: Tensor) -> None:
    """Add a block's ``grad`` ``[h b, n, d]`` at rows ``at`` ``[b n]`` of ``buffer`` ``[K, h, d]``."""
    heads = buffer.shape[1]
    buffer.transpose(0, 1).index_add_(1, at, grad.unflatten(0, (heads, -1)).flatten(1, 2))


def _blocks(
    selected_shape: torch.Size, kv_heads: int, heads: int, keys: Tensor, values: Tensor | None
) -> list[tuple[slice, slice, slice]]:
    """``(tokens, key/value heads, query heads)`` of each block of a round (:func:`query_block`), the heads
    inner."""
    tokens, width = selected_shape
    group = heads // kv_heads
    dims = keys.shape[-1] + (0 if values is None else values.shape[-1])
    size, per_block = query_block(width, kv_heads, group, dims)
    return [
        (slice(start, min(start + size, tokens)), slice(first, last), slice(first * group, last * group))
        for start in range(0, tokens, size)
        for first, last in ((h, min(h + per_block, kv_heads)) for h in range(0, kv_heads, per_block))
    ]


def _selected(
    keys: Tensor, values: Tensor | None, value_dim: int, selected: Tensor, heads: slice
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A block's ``[b, n]`` selection as int64 rows (``-1`` read as row 0), its selected keys ``[h b, n, D]``
    and values ``[h b, n, Dv]`` of key/value ``heads`` in the accumulation dtype (each gathered once for all
    the query heads that read it; the values a view of the keys when they are their columns), and where the
    selection is ``-1``. Heads lead, so that the products are batched matrix products of these tensors as
    they are (no copy)."""
    rows = selected.clamp(min=0).long()
    block_keys = _up(keys[:, heads].transpose(0, 1)[:, rows].flatten(0, 1))
    if values is None:
        block_values = block_keys[..., :value_dim]
    else:
        block_values = _up(values[:, heads].transpose(0, 1)[:, rows].flatten(0, 1))
    return rows, block_keys, block_values, selected < 0


def _accumulation(x: Tensor) -> torch.dtype:
    """fp32, or float64 for float64 ``x`` (a rule in Python: ``torch.promote_types`` is an operator)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _up(x: Tensor) -> Tensor:
    """``x`` in its accumulation dtype (:func:`_accumulation`)."""
    return x.to(_accumulation(x))


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """``[b, Hq_block, d]`` -> ``[h b, g, d]`` in the accumulation dtype: query head ``i`` reads key/value
    head ``i // g``."""
    if kv_heads == 1:  # already so: spares a block three view operators
        return _up(x)
    return _up(x.unflatten(1, (kv_heads, -1)).transpose(0, 1).flatten(0, 1))


def _ungrouped(x: Tensor, kv_heads: int) -> Tensor:
    """``[h b, g, d]`` -> ``[b, Hq_block, d]`` (:func:`_grouped`'s inverse)."""
    if kv_heads == 1:
        return x
    return x.unflatten(0, (kv_heads, -1)).transpose(0, 1).flatten(1, 2)


def _probabilities(
    queries: Tensor, keys: Tensor, invalid: Tensor, scale: float, lse: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Softmax ``[h b, g, n]`` of ``queries`` ``[h b, g, D]`` over their selected ``keys`` ``[h b, n, D]``
    (``invalid`` ``[b, n]``: where the selection is ``-1``), and its log-sum-exp ``[h b, g, 1]``; from a saved
    ``lse`` (a sink's share included) when given. Made in the scores' storage."""
    scores = torch.bmm(queries, keys.transpose(1, 2)).mul_(scale)
    scores.unflatten(0, (-1, invalid.shape[0])).masked_fill_(invalid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True) if lse is None else lse
    return scores.sub_(lse).exp_(), lse
