"""CP attention by the all-gather of keys and values, and one rank's attention over sequences it holds whole.

Every rank keeps its own queries; the keys and values of every rank are all-gathered over the CP group (one
collective for both, only the key/value heads: with grouped-query attention ``Hkv``, not ``Hq``, heads) in
rounds of key/value heads (:meth:`AttentionMode.heads_per_gather
<lightning_cp.parallel.attention_mode.AttentionMode.heads_per_gather>`; each query head reads only its own
key/value head, so the rounds do not change the numbers). The batch's shard puts the keys this rank reads
in sequence order, once (:attr:`KeySelection.order <lightning_cp.parallel._key_selection.KeySelection.order>`);
each local chunk of each sequence (a *piece*) attends to one contiguous range of them, read in place by a
variable-length causal kernel (FlashAttention-2 calls, :mod:`lightning_cp.parallel._flash_calls`, or the
blocked torch kernel, :mod:`lightning_cp.parallel._varlen`).

Memory: the gathered keys and values live only inside the forward and the backward of a layer. The backward
all-gathers them again instead of keeping them, so a layer saves ``O(T_local)`` (its local ``q``, ``k``,
``v``, output and log-sum-exp). Per round the sequence-sized buffers are the gathered keys and values (while
they are put in sequence order), those in sequence order and, in the backward, their gradients at their
gathered rows (fp32; the blocked kernel sums them in sequence order first), which one reduce-scatter (an
all-reduce on gloo, which has none) sums over the ranks and returns to the keys' owners:
``kv_heads_per_gather / Hkv`` of every head's at a time. A
key's gradient is a sum over the pieces and ranks whose queries read it, summed in fp32 and rounded to the
keys' dtype once.

With one rank (no CP, or sequences a rank holds whole: Ulysses) the same kernels run over the rank's own
keys, in place, and nothing is gathered (:func:`local_attention`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_cp.parallel import _flash_calls, _varlen
from lightning_cp.parallel._key_selection import KeySelection, select_row_keys, shard_keys
from lightning_cp.parallel.attention_mode import gathered_bytes_per_head
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.shard import CPShard


def allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: CPShard,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """CP attention of this rank's ``q`` ``[B, Hq, S_local, D]`` over the keys and values ``[B, Hkv,
    S_local, D / Dv]`` of every rank of the shard's CP group, all-gathered: ``[B, Hq, S_local, Dv]``.

    Arguments as :func:`~lightning_cp.parallel.context_parallel_attention` takes them (checked, one dtype).

    Communication: per round of key/value heads, one all-gather of K and V over the shard's CP group in the
    forward; in the backward the same all-gather again and one reduce-scatter (NCCL) or all-reduce (gloo) of
    their gradients (fp32). With a window the whole K/V are still gathered; only the keys each piece
    reaches are selected.
    """
    batch, heads, local_len, _ = q.shape
    exchange = shard.group_exchange()
    if batch * local_len == 0:
        return q.new_empty((batch, heads, local_len, v.shape[-1]))
    keys = shard_keys(shard, window)
    per_round = k.shape[1]
    if keys.order is not None:
        per_head = gathered_bytes_per_head(keys.gathered_tokens, k.shape[-1], v.shape[-1], k.element_size())
        per_round = shard.attention.heads_per_gather(k.shape[1], per_head, shard.kv_gather_budget)
    out = AllGatherAttention.apply(
        token_major(q), token_major(k), token_major(v), sinks, keys, exchange, scale, softcap, per_round
    )
    return out.view(batch, local_len, heads, v.shape[-1]).transpose(1, 2)


def local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: CPShard | None,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """One rank's causal attention over sequences it holds whole: every row of ``q`` ``[B, Hq, S, D]`` one
    sequence (``shard=None``), or the sequences of a shard of one rank (packed documents). Returns
    ``[B, Hq, S, Dv]``. Rows that are whole sequences with none of ``window``, ``softcap``, ``sinks`` take the
    fused causal SDPA; the rest the kernels of :func:`allgather_attention` with nothing to gather. No
    communication."""
    batch, heads, length, _ = q.shape
    # Without softcap and sinks, a window that covers the whole row changes nothing.
    plain = softcap is None and sinks is None and (window is None or window >= length)
    if plain and (shard is None or shard.num_sequences == batch):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != heads
        )
    if batch * length == 0:
        return q.new_empty((batch, heads, length, v.shape[-1]))
    keys = select_row_keys(batch, length, window, q.device) if shard is None else shard_keys(shard, window)
    out = AllGatherAttention.apply(
        token_major(q),
        token_major(k),
        token_major(v),
        sinks,
        keys,
        GroupExchange(),
        scale,
        softcap,
        k.shape[1],
    )
    return out.view(batch, length, heads, v.shape[-1]).transpose(1, 2)


def token_major(x: Tensor) -> Tensor:
    """``[B, H, S, d]`` -> ``[B * S, H, d]``: the tokens of the rows one after the other."""
    return x.transpose(1, 2).flatten(0, 1)


class AllGatherAttention(torch.autograd.Function):
    """Token-major attention of this rank's pieces: ``q [T_local, Hq, D]``, ``k [T_local, Hkv, D]``,
    ``v [T_local, Hkv, Dv]`` and optional ``sinks [Hq]`` -> ``[T_local, Hq, Dv]``, over the keys of ``keys``
    gathered through ``exchange`` (nothing gathered when ``keys.order`` is ``None``), ``per_round`` key/value
    heads (and the query heads that read them) at a time.

    Saves only the local tensors; the backward gathers the keys and values again.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        keys: KeySelection,
        exchange: GroupExchange,
        scale: float,
        softcap: float | None,
        per_round: int,
    ) -> Tensor:
        q = q.contiguous()
        flash = _varlen.use_flash(q, k, v, softcap)
        out = q.new_empty((*q.shape[:2], v.shape[-1]))
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.promote_types(q.dtype, torch.float32))
        rngs = []
        for kv_heads, q_heads in head_rounds(k.shape[1], q.shape[1], per_round):
            ordered_k, ordered_v = _ordered_keys(_heads(k, kv_heads), _heads(v, kv_heads), keys, exchange)
            round_out, round_lse, rng = round_forward(
                _heads(q, q_heads), ordered_k, ordered_v, keys, scale, softcap, flash
            )
            rngs.append(rng)
            del ordered_k, ordered_v
            out[:, q_heads] = round_out
            lse[q_heads] = round_lse
        if sinks is not None:
            out, lse = _varlen.add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.keys, ctx.exchange, ctx.scale, ctx.softcap = keys, exchange, scale, softcap
        ctx.per_round, ctx.rngs = per_round, rngs if flash else None
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        keys, exchange, scale = ctx.keys, ctx.exchange, ctx.scale
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for index, (kv_heads, q_heads) in enumerate(head_rounds(k.shape[1], q.shape[1], ctx.per_round)):
            round_q, round_k, round_v = _heads(q, q_heads), _heads(k, kv_heads), _heads(v, kv_heads)
            round_dout, round_out = _heads(dout, q_heads), _heads(out, q_heads)
            round_lse = lse[q_heads].contiguous()
            if ctx.rngs is not None:
                round_dk, round_dv, full = _key_gradient_buffers(round_k, round_v, keys)
                round_dq = _flash_calls.backward(
                    round_dout,
                    round_q,
                    lambda k=round_k, v=round_v: _ordered_keys(k, v, keys, exchange),
                    round_out,
                    round_lse,
                    keys,
                    scale,
                    ctx.rngs[index],
                    round_dk,
                    round_dv,
                )
            else:
                ordered_k, ordered_v = _ordered_keys(round_k, round_v, keys, exchange)
                round_dq, round_dk, round_dv = round_backward(
                    round_dout,
                    round_q,
                    ordered_k,
                    ordered_v,
                    round_out,
                    round_lse,
                    keys,
                    scale,
                    ctx.softcap,
                    None,
                )
                del ordered_k, ordered_v
                full = None if keys.order is None else _rank_major(round_dk, round_dv, keys)
            if full is not None:
                del round_dk, round_dv
                local = exchange.reduce_scatter(full)
                del full
                split = round_k.shape[1] * round_k.shape[2]
                round_dk = local[:, :split].unflatten(1, round_k.shape[1:])
                round_dv = local[:, split:].unflatten(1, round_v.shape[1:])
            dq[:, q_heads], dk[:, kv_heads], dv[:, kv_heads] = round_dq, round_dk, round_dv
        dsinks = _varlen.sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None


def round_forward(
    q: Tensor, k: Tensor, v: Tensor, keys: KeySelection, scale: float, softcap: float | None, flash: bool
) -> tuple[Tensor, Tensor, list[_flash_calls.Rng] | None]:
    """One round's kernel forward over the keys ``k`` ``[K, h, D]`` and values ``v`` ``[K, h, Dv]`` in
    sequence order: ``(out [T_local, hq, Dv], lse [hq, T_local], rng)``, by FlashAttention-2 (``flash``, see
    :func:`~lightning_cp.parallel._varlen.use_flash`; ``rng`` for its backward) or the blocked torch kernel
    (``rng`` ``None``)."""
    if flash:
        return _flash_calls.forward(q, k, v, keys, scale)
    out, lse = _varlen.torch_forward(q, k, v, keys.pieces, scale, window=keys.window, softcap=softcap)
    return out, lse, None


def round_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    keys: KeySelection,
    scale: float,
    softcap: float | None,
    rngs: list[_flash_calls.Rng] | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`round_forward` (``rngs`` what it returned): ``(dq, dk, dv)``, ``dk`` ``[K, h,
    D]`` and ``dv`` ``[K, h, Dv]`` in sequence order and in the accumulation dtype (fp32), each key's
    gradient summed over this rank's pieces. No communication."""
    if rngs is None:
        return _varlen.torch_backward(
            dout, q, k, v, out, lse, keys.pieces, scale, window=keys.window, softcap=softcap
        )
    local = dataclasses.replace(keys, order=None)  # the calls add at the keys' rows in sequence order
    dk, dv, _ = _key_gradient_buffers(k, v, local)
    dq = _flash_calls.backward(dout, q, lambda: (k, v), out, lse, local, scale, rngs, dk, dv)
    return dq, dk, dv


def _ordered_keys(k: Tensor, v: Tensor, keys: KeySelection, exchange: GroupExchange) -> tuple[Tensor, Tensor]:
    """The keys ``[K, Hkv, D]`` and values ``[K, Hkv, Dv]`` of this rank's pieces, in sequence order.

    One all-gather brings every rank's keys and values (flattened side by side, so ``Dv`` may differ from
    ``D``); ``keys.order`` puts the ones the pieces read in sequence order, once (the gathered buffer is
    freed as soon as they are). Both results are views of that one ``[K, Hkv * (D + Dv)]`` buffer.
    """
    if keys.order is None:
        return k, v
    kv = exchange.all_gather(torch.cat([k.flatten(1), v.flatten(1)], dim=1)).index_select(0, keys.order)
    split = k.shape[1] * k.shape[2]
    return kv[:, :split].unflatten(1, k.shape[1:]), kv[:, split:].unflatten(1, v.shape[1:])


def _key_gradient_buffers(k: Tensor, v: Tensor, keys: KeySelection) -> tuple[Tensor, Tensor, Tensor | None]:
    """Zeroed fp32 buffers for the key and value gradients: ``(dk, dv, None)`` of the keys' own ``[K]`` rows
    when nothing is gathered, else views ``(dk, dv, full)`` of the rank-major ``[cp * T_local, Hkv * (D +
    Dv)]`` buffer the reduce-scatter sums (the keys in sequence order at their gathered rows
    ``keys.order``), so that the calls add into it directly."""
    accumulate = torch.promote_types(k.dtype, torch.float32)
    if keys.order is None:
        return k.new_zeros(k.shape, dtype=accumulate), v.new_zeros(v.shape, dtype=accumulate), None
    split = k.shape[1] * k.shape[2]
    full = k.new_zeros((keys.gathered_tokens, split + v.shape[1] * v.shape[2]), dtype=accumulate)
    return full[:, :split].unflatten(1, k.shape[1:]), full[:, split:].unflatten(1, v.shape[1:]), full


def _rank_major(dk: Tensor, dv: Tensor, keys: KeySelection) -> Tensor:
    """The key and value gradients ``[K, ...]`` (sequence order) at their gathered rows, zeros elsewhere:
    ``[cp * T_local, Hkv * (D + Dv)]`` in their (accumulation) dtype, what the reduce-scatter sums and
    returns to the keys' owners."""
    split = dk.shape[1] * dk.shape[2]
    full = dk.new_zeros((keys.gathered_tokens, split + dv.shape[1] * dv.shape[2]))
    full[:, :split].index_copy_(0, keys.order, dk.flatten(1))
    full[:, split:].index_copy_(0, keys.order, dv.flatten(1))
    return full


def head_rounds(kv_heads: int, heads: int, per_round: int) -> list[tuple[slice, slice]]:
    """``(key/value heads, query heads)`` of each round: ``per_round`` key/value heads (a divisor of
    ``kv_heads``) and the query heads that read them (query head ``h`` reads key/value head
    ``h // (heads / kv_heads)``)."""
    group = heads // kv_heads
    return [
        (slice(first, first + per_round), slice(first * group, (first + per_round) * group))
        for first in range(0, kv_heads, per_round)
    ]


def _heads(x: Tensor, heads: slice) -> Tensor:
    """``x[:, heads]`` contiguous (the whole tensor when ``heads`` are all of them)."""
    return x if heads == slice(0, x.shape[1]) else x[:, heads].contiguous()
