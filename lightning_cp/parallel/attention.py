"""Context-parallel causal attention, without TransformerEngine, for padded and packed batches.

Each CP rank holds the queries, keys and values of its own tokens in the load-balanced layout made by
:func:`lightning_cp.parallel.shard_batch` (chunks ``r`` and ``2 * cp - 1 - r`` of every sequence). Keys
and values are all-gathered over the CP group (one collective for both, only the key/value heads: with
grouped-query attention that is ``Hkv``, not ``Hq``, heads). The batch's
:class:`~lightning_cp.parallel.CPShard` then puts the keys this rank reads in sequence order, once:
each local chunk of each sequence (a *piece*) attends to one contiguous range of them, the keys of that
sequence up to the chunk's end (from where the chunk's sliding window starts, with a window:
:mod:`lightning_cp.parallel._key_selection`), read in place by a variable-length causal kernel (:mod:`lightning_cp.parallel._varlen`: FlashAttention-2 varlen on CUDA, an exact
blocked torch kernel elsewhere). Documents of a packed batch never see each other, and no
``[T_local, T_total]`` mask is ever built. Sliding windows, logit softcapping, attention sinks and a value
head dim of its own are exact on every path.

Memory: the gathered keys and values live only inside the forward and the backward of a layer. The
backward all-gathers them again instead of keeping them, so a layer saves ``O(T_local)`` (its local
``q``, ``k``, ``v``, output and log-sum-exp), and returns dK, dV to their owners with one
reduce-scatter (an all-reduce on gloo, which has none). A key's gradient is a sum over every piece and
rank whose queries read it: it is summed in fp32 (the kernels' accumulation dtype), the reduce-scatter
too, and rounded to the keys' dtype once. At most two sequence-sized K/V buffers are alive
at a time (:class:`_CPAttention`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_cp.parallel import _varlen
from lightning_cp.parallel._key_selection import KeySelection, Rows, select_row_keys
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.head_parallel import head_slices, shared_heads, to_heads, to_tokens
from lightning_cp.parallel.sharding import CPShard


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cp_shard: CPShard | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention over the whole sequences while each rank holds only its shard.

    Every variant below is exact (the same as on the full sequence, outputs and gradients) for padded and
    packed batches, any CP size, and grouped- or multi-query attention; they combine freely.

    Args:
        q: ``[B, Hq, S_local, D]``, this rank's queries in ``shard_batch``'s layout (any float dtype).
        k: ``[B, Hkv, S_local, D]`` with ``Hkv`` dividing ``Hq`` (grouped- or multi-query attention when
            smaller); on ``q``'s device. ``q``, ``k``, ``v`` are cast to one compute dtype
            (:func:`compute_dtype`: autocast's under autocast, as SDPA does, else the widest of the three),
            in which the kernel is chosen and the keys and values are exchanged.
        v: ``[B, Hkv, S_local, Dv]``; ``Dv`` may differ from ``D`` (DeepSeek's multi-head latent attention).
        cp_shard: the batch's ``batch["cp_shard"]`` from :func:`~lightning_cp.parallel.shard_batch`, which
            carries the CP group the batch was split over (``cp_shard.exchange``). Required for packed
            batches and under CP; without it every row is one whole sequence and this is plain causal
            attention over the local tokens.
        scale: softmax scale, default ``D ** -0.5`` (Gemma's ``query_pre_attn_scalar ** -0.5``, Granite's
            ``attention_multiplier``); a positive number.
        window: sliding window in tokens, ``transformers``' ``sliding_window``: the query at position ``i``
            of a sequence sees key ``j`` iff ``i - window < j <= i`` (``window=1``: itself only). ``None``:
            full causal attention. Per call, so per layer: models that alternate windowed and global layers
            pass it on the windowed ones. Each piece's keys start at its window
            (:meth:`CPShard.keys <lightning_cp.parallel.CPShard.keys>`, built once per batch and window).
        softcap: attention logit softcapping (Gemma-2's ``attn_logit_softcapping``), a positive number:
            scores become ``softcap * tanh(scale * q . k / softcap)`` before the mask and the softmax.
        sinks: ``[Hq]`` attention sinks (gpt-oss's ``sinks``, passed as ``s_aux``): one learned logit per
            query head that joins every softmax denominator without a value, so a query may attend to
            "nothing". Differentiable: its gradient is returned like ``q``'s.

    Returns:
        ``[B, Hq, S_local, Dv]``: the attention output of this rank's queries, in the compute dtype.

    Kernels: on CUDA with fp16 / bf16 inputs and head dims (the larger of ``D``, ``Dv``) that are multiples
    of 8 up to 256, PyTorch's FlashAttention-2 varlen kernels (``window`` through their window arguments,
    ``Dv != D`` through zero padding of the smaller head dim, ``sinks`` as a correction through the
    log-sum-exp). Everywhere else, and on CUDA whenever ``softcap`` is set (FlashAttention-2 has none), an
    exact blocked torch kernel that computes in fp32 with one bounded block of scores at a time
    (slower than FlashAttention on CUDA). The choice is logged once per process. Without CP or a shard,
    rows that are whole sequences with none of ``window``, ``softcap``, ``sinks`` take the fused causal SDPA.

    Communication: one all-gather of K and V over the shard's CP group in the forward; in the backward the same
    all-gather again and one reduce-scatter (NCCL) or all-reduce (gloo) of their gradients. With a window
    the whole K/V are still gathered; only the keys each piece reaches are selected.

    Raises:
        ValueError: on inconsistent shapes, a shard of another batch, or a ``scale``, ``window``,
            ``softcap`` or ``sinks`` that is not as described above.
    """
    _check_shapes(q, k, v)
    scale = _check_variants(q, scale, window, softcap, sinks)
    dtype = compute_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # Autocast would run the blocked kernel's einsums in its dtype in the forward but not in the backward:
    # the inputs are in the compute dtype already, and the kernels choose their own accumulation.
    with torch.autocast(q.device.type, enabled=False) if _autocast_on(q) else contextlib.nullcontext():
        return _attention(q, k, v, cp_shard, scale, window, softcap, sinks)


def compute_dtype(q: Tensor, k: Tensor, v: Tensor) -> torch.dtype:
    """The dtype attention of ``q``, ``k``, ``v`` computes in, what SDPA would: under autocast for their
    device, autocast's dtype (float64 inputs stay float64, as autocast leaves them); else the widest of
    the three (with mixed precision's fp32 rotary tables, q and k arrive fp32 beside a bf16 v)."""
    dtypes = [q.dtype, k.dtype, v.dtype]
    if _autocast_on(q):
        low = torch.get_autocast_dtype(q.device.type)
        dtypes = [d if d == torch.float64 else low for d in dtypes]
    return functools.reduce(torch.promote_types, dtypes)


def _autocast_on(x: Tensor) -> bool:
    return torch.is_autocast_enabled(x.device.type)


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_shard: CPShard | None,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """:func:`context_parallel_attention` of checked ``q``, ``k``, ``v`` of one dtype, outside autocast."""
    batch, heads, local_len, _ = q.shape
    # Without softcap and sinks, a window that covers the whole row changes nothing.
    plain = softcap is None and sinks is None and (window is None or window >= local_len)
    if cp_shard is None:
        if plain:
            return _causal_rows(q, k, v, scale)
        exchange = GroupExchange()
    else:
        if cp_shard.local_tokens != batch * local_len:
            raise ValueError(
                f"cp_shard describes {cp_shard.local_tokens} local tokens but q holds B * S_local = "
                f"{batch} * {local_len}; pass the shard of the batch these tensors come from."
            )
        if plain and cp_shard.split.cp_size == 1 and cp_shard.num_sequences == batch:
            return _causal_rows(q, k, v, scale)  # one sequence per row, all local: the fused causal kernel
        if cp_shard.attention.ulysses(heads, k.shape[1], cp_shard.split.cp_size):
            return _ulysses(q, k, v, cp_shard, scale, window, softcap, sinks)
        exchange = cp_shard.group_exchange()
    if batch * local_len == 0:
        return q.new_empty((batch, heads, local_len, v.shape[-1]))
    keys = select_row_keys(batch, local_len, window, q.device) if cp_shard is None else cp_shard.keys(window)
    rounds = 1
    if cp_shard is not None and keys.order is not None:
        per_head = 2 * keys.gathered_tokens * (k.shape[-1] + v.shape[-1]) * k.element_size()
        per_round = cp_shard.attention.heads_per_gather(k.shape[1], per_head, cp_shard.kv_gather_budget)
        rounds = k.shape[1] // per_round
    out = _CPAttention.apply(
        _token_major(q), _token_major(k), _token_major(v), sinks, keys, exchange, scale, softcap, rounds
    )
    return out.view(batch, local_len, heads, v.shape[-1]).transpose(1, 2)


def _ulysses(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: CPShard,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """Ulysses attention: every token of ``Hq / cp`` query heads (and the key/value heads they read) by one
    all-to-all, the one-rank kernels on whole sequences, the output back by one all-to-all."""
    batch, heads, local_len, _ = q.shape
    rank = shard.split.cp_rank
    query_heads = head_slices(heads, shard.split.cp_size, "query heads")
    kv_heads = shared_heads(query_heads, heads, k.shape[1], "key/value heads")

    def rows(x: Tensor) -> Tensor:  # [T_seq, h, d] -> [1, h, T_seq, d]
        return x.transpose(0, 1).unsqueeze(0)

    qs, ks, vs = to_heads(
        shard, (_token_major(q), query_heads), (_token_major(k), kv_heads), (_token_major(v), kv_heads)
    )
    own_sinks = None if sinks is None else sinks.index_select(0, shard.device_index(query_heads[rank]))
    out = context_parallel_attention(
        rows(qs),
        rows(ks),
        rows(vs),
        cp_shard=shard.whole_sequences(),
        scale=scale,
        window=window,
        softcap=softcap,
        sinks=own_sinks,
    )
    out = to_tokens(shard, out[0].transpose(0, 1))  # [T_local, Hq, Dv]
    return out.reshape(batch, local_len, heads, -1).transpose(1, 2)


def _token_major(x: Tensor) -> Tensor:
    """``[B, H, S, d]`` -> ``[B * S, H, d]``: the tokens of the rows one after the other."""
    return x.transpose(1, 2).flatten(0, 1)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "q must be [B, Hq, S_local, D], k [B, Hkv, S_local, D] and v [B, Hkv, S_local, Dv]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    batch, heads, local_len, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != batch or k.shape[2] != local_len or k.shape[3] != dim or heads % kv_heads:
        raise ValueError(
            f"k, v {tuple(k.shape)} do not fit q {tuple(q.shape)}: they need the same B and S_local, k "
            f"the same D, and their head count ({kv_heads}) must divide q's ({heads})."
        )
    return batch, heads, local_len


def _check_variants(
    q: Tensor, scale: float | None, window: int | None, softcap: float | None, sinks: Tensor | None
) -> float:
    """Validate the variant arguments; return the scale to use."""
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a positive finite number (the default is D ** -0.5).")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"window={window!r} must be a positive integer number of tokens (a query sees itself and the "
            "window - 1 tokens before it), or None for full causal attention."
        )
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(
            f"softcap={softcap!r} must be a positive finite number (scores become "
            "softcap * tanh(score / softcap)), or None for no softcapping."
        )
    if sinks is not None and (
        not isinstance(sinks, Tensor)
        or sinks.shape != (q.shape[1],)
        or not sinks.is_floating_point()
        or sinks.device != q.device
    ):
        described = (
            f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}" if isinstance(sinks, Tensor) else sinks
        )
        raise ValueError(
            f"sinks must be a float tensor [Hq] = [{q.shape[1]}] on {q.device}, one logit per query head; "
            f"got {described}."
        )
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def _causal_rows(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Plain causal attention of each row over its own tokens (no CP: the row is the whole sequence)."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


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


def _rank_major(dk: Tensor, dv: Tensor, keys: KeySelection) -> Tensor:
    """The key and value gradients ``[K, ...]`` (sequence order) at their gathered rows, zeros elsewhere:
    ``[cp * T_local, Hkv * (D + Dv)]`` in their (accumulation) dtype, what the reduce-scatter sums and
    returns to the keys' owners."""
    split = dk.shape[1] * dk.shape[2]
    full = dk.new_zeros((keys.gathered_tokens, split + dv.shape[1] * dv.shape[2]))
    full[:, :split].index_copy_(0, keys.order, dk.flatten(1))
    full[:, split:].index_copy_(0, keys.order, dv.flatten(1))
    return full


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


def _flash_forward(
    q: Tensor, k: Tensor, v: Tensor, keys: KeySelection, scale: float
) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
    """FlashAttention-2 varlen over ``keys.calls``: ``(out [T_local, Hq, Dv], lse [Hq, T_local], rng per call)``.

    ``k``, ``v`` are the keys in sequence order; a call reads them in place where its pieces' keys lie back
    to back, else copies its own rows.
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


def _flash_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    keys: KeySelection,
    exchange: GroupExchange,
    scale: float,
    rngs: list[tuple[Tensor, Tensor]],
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`_flash_forward` from this rank's ``k``, ``v`` (gathered again here);
    ``dk``, ``dv`` ``[K, ...]`` in sequence order, summed over the calls in fp32 (the kernel's
    accumulation dtype: a bf16 sum would round at every call).

    The first call's key gradients become the accumulators when it reads every key in place (full causal
    attention); the keys in sequence order are released before the last call when it reads a copy.
    """
    accumulate = torch.promote_types(k.dtype, torch.float32)
    k, v = _ordered_keys(k, v, keys, exchange)
    dq = torch.empty_like(q)
    dk = dv = None
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
        if dk is None and isinstance(call.keys, slice) and call.keys == slice(0, keys.num_keys):
            dk, dv = grads[1].to(accumulate), grads[2].to(accumulate)
            continue
        if dk is None:
            dk = q.new_zeros((keys.num_keys, *grads[1].shape[1:]), dtype=accumulate)
            dv = q.new_zeros((keys.num_keys, *grads[2].shape[1:]), dtype=accumulate)
        _add(dk, call.keys, grads[1])
        _add(dv, call.keys, grads[2])
    return dq, dk, dv


class _CPAttention(torch.autograd.Function):
    """Token-major CP attention: ``q [T_local, Hq, D]``, ``k [T_local, Hkv, D]``, ``v [T_local, Hkv, Dv]``
    and optional ``sinks [Hq]`` -> ``[T_local, Hq, Dv]``, over the pieces and keys of ``keys``, in ``rounds``
    rounds of ``Hkv / rounds`` key/value heads (and the query heads that read them).

    Saves only the local tensors; the backward exchanges the keys and values again. Per layer and round,
    the K/V in flight are the round's gathered buffer while it is put in sequence order, then its keys in
    sequence order and (backward) their gradients (fp32), then those gradients at their gathered rows
    (fp32) for the reduce-scatter: ``1 / rounds`` of all heads' at a time.
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
        rounds: int,
    ) -> Tensor:
        q = q.contiguous()
        flash = _varlen.use_flash(q, k, v, softcap)
        out = q.new_empty((*q.shape[:2], v.shape[-1]))
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.promote_types(q.dtype, torch.float32))
        rngs = []
        for kv_heads, q_heads in _rounds(k.shape[1], q.shape[1], rounds):
            ordered_k, ordered_v = _ordered_keys(_heads(k, kv_heads), _heads(v, kv_heads), keys, exchange)
            round_q = _heads(q, q_heads)
            if flash:
                round_out, round_lse, rng = _flash_forward(round_q, ordered_k, ordered_v, keys, scale)
                rngs.append(rng)
            else:
                round_out, round_lse = _varlen.torch_forward(
                    round_q, ordered_k, ordered_v, keys.pieces, scale, window=keys.window, softcap=softcap
                )
            del ordered_k, ordered_v
            out[:, q_heads] = round_out
            lse[q_heads] = round_lse
        if sinks is not None:
            out, lse = _varlen.add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.keys, ctx.exchange, ctx.scale, ctx.softcap = keys, exchange, scale, softcap
        ctx.rounds, ctx.rngs = rounds, rngs if flash else None
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        keys, scale = ctx.keys, ctx.scale
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for index, (kv_heads, q_heads) in enumerate(_rounds(k.shape[1], q.shape[1], ctx.rounds)):
            round_q, round_k, round_v = _heads(q, q_heads), _heads(k, kv_heads), _heads(v, kv_heads)
            round_dout, round_out = _heads(dout, q_heads), _heads(out, q_heads)
            round_lse = lse[q_heads].contiguous()
            if ctx.rngs is not None:
                round_dq, round_dk, round_dv = _flash_backward(
                    round_dout,
                    round_q,
                    round_k,
                    round_v,
                    round_out,
                    round_lse,
                    keys,
                    ctx.exchange,
                    scale,
                    ctx.rngs[index],
                )
            else:
                ordered_k, ordered_v = _ordered_keys(round_k, round_v, keys, ctx.exchange)
                round_dq, round_dk, round_dv = _varlen.torch_backward(
                    round_dout,
                    round_q,
                    ordered_k,
                    ordered_v,
                    round_out,
                    round_lse,
                    keys.pieces,
                    scale,
                    window=keys.window,
                    softcap=ctx.softcap,
                )
                del ordered_k, ordered_v
            if keys.order is not None:
                full = _rank_major(round_dk, round_dv, keys)
                del round_dk, round_dv
                local = ctx.exchange.reduce_scatter(full)
                del full
                split = round_k.shape[1] * round_k.shape[2]
                round_dk = local[:, :split].unflatten(1, round_k.shape[1:])
                round_dv = local[:, split:].unflatten(1, round_v.shape[1:])
            dq[:, q_heads], dk[:, kv_heads], dv[:, kv_heads] = round_dq, round_dk, round_dv
        dsinks = _varlen.sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None


def _rounds(kv_heads: int, heads: int, rounds: int) -> list[tuple[slice, slice]]:
    """``(key/value heads, query heads)`` of each round: ``kv_heads / rounds`` key/value heads and the query
    heads that read them (query head ``h`` reads key/value head ``h // (heads / kv_heads)``)."""
    per_round, group = kv_heads // rounds, heads // kv_heads
    return [
        (slice(r * per_round, (r + 1) * per_round), slice(r * per_round * group, (r + 1) * per_round * group))
        for r in range(rounds)
    ]


def _heads(x: Tensor, heads: slice) -> Tensor:
    """``x[:, heads]`` contiguous (the whole tensor when ``heads`` are all of them)."""
    return x if heads == slice(0, x.shape[1]) else x[:, heads].contiguous()
