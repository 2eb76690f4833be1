"""CP attention of multi-head latent attention (MLA): the latent exchanged, not every head's keys and values.

An MLA layer (DeepSeek-V2/V3/V3.2, GLM-4.7-Flash, Kimi, MiniCPM3, ...) stores one compressed latent per token
(``kv_lora_rank`` values, normalized) and one rotary key part (``qk_rope_head_dim`` values, rotary applied)
shared by all heads, and expands them to every head's key ``[K_nope, k_rot]`` and value with its ``kv_b_proj``
(a weight ``[H * (Dn + Dv), R]``, no bias). All-gathering the expanded keys and values (what the attention
interface is handed) moves ``H * (Dn + Dr + Dv)`` values per token (40,960 at DeepSeek-V3's shape); the
latent and the rotary part are ``R + Dr`` (576).

:func:`latent_attention` all-gathers the latent and the rotary part once per layer (one ``[T_local, R + Dr]``
tensor), puts the keys this rank's pieces read in sequence order (the all-gather attention's
:class:`~lightning_cp.parallel._key_selection.KeySelection`), and expands them per round of heads (the
all-gather's :meth:`AttentionMode.heads_per_gather
<lightning_cp.parallel.attention_mode.AttentionMode.heads_per_gather>` rounds, sized by the expanded bytes per
head) with the layer's weight, running the all-gather attention's kernels on each round
(FlashAttention-2 varlen on CUDA, the exact blocked torch kernel elsewhere). The forward saves the local
inputs, the output and the log-sum-exp only.

The backward gathers the latent again, re-expands each round, runs the kernels' backward to the keys' and
values' gradients in sequence order (fp32), and folds them back through the expansion: ``d latent +=
dK_nope @ W_k + dV @ W_v``, ``d k_rot += dK_rot`` summed over the heads, ``dW[heads] = [dK_nope; dV]^T @
latent`` (fp32). One reduce-scatter returns each rank the latent's and rotary part's gradients of its own
tokens. The weight's gradient is this rank's partial sum (over its own queries): the strategies sum parameter
gradients over the CP group, as they do for every other weight.

Windows, logit softcapping and attention sinks are the all-gather attention's (the kernels take them). The
exchange is the same whatever the batch's attention mode: under Ulysses too the latent is fewer bytes than
the all-to-all of every head's queries, keys and values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_cp import products
from lightning_cp.parallel import _varlen
from lightning_cp.parallel._allgather_attention import (
    _heads,
    head_rounds,
    round_backward,
    round_forward,
    token_major,
)
from lightning_cp.parallel._key_selection import KeySelection, select_row_keys, shard_keys
from lightning_cp.parallel.attention import _check_variants, compute_dtype
from lightning_cp.parallel.attention_mode import gathered_bytes_per_head
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.shard import CPShard


def latent_attention(
    q: Tensor,
    latent: Tensor,
    k_rot: Tensor,
    weight: Tensor,
    *,
    cp_shard: CPShard | None,
    value_dim: int,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention of this rank's queries over the whole sequences' MLA keys and values, expanded here
    from the all-gathered latent.

    Args:
        q: ``[B, H, S_local, Dn + Dr]``, this rank's queries (rotary applied to their last ``Dr``).
        latent: ``[B, 1, S_local, R]``, this rank's normalized latents (``kv_a_layernorm``'s output).
        k_rot: ``[B, 1, S_local, Dr]``, this rank's rotary key part (rotary applied), shared by the heads.
        weight: ``[H * (Dn + Dv), R]``, ``kv_b_proj.weight``: head ``h``'s rows are ``K_nope`` (``Dn``) then
            ``V`` (``Dv``). It gets this rank's partial gradient (its own queries').
        cp_shard: the batch's shard (``batch["cp_shard"]``); ``None``: every row one whole sequence.
        value_dim: ``Dv``.
        scale, window, softcap, sinks: as :func:`~lightning_cp.parallel.context_parallel_attention` takes
            them (``scale`` by default ``(Dn + Dr) ** -0.5``).

    Returns:
        ``[B, H, S_local, Dv]`` in the compute dtype (:func:`~lightning_cp.parallel.attention.compute_dtype`
        of ``q``, ``latent``, ``k_rot``; ``weight`` is cast to it as autocast casts ``kv_b_proj``).

    Communication, over the shard's CP group when it has more than one rank: one all-gather of ``[T_local, R
    + Dr]`` per layer in the forward; in the backward the same all-gather and one reduce-scatter (NCCL) or
    all-reduce (gloo) of ``[cp * T_local, R + Dr]`` fp32. None otherwise.

    Raises:
        ValueError: shapes that do not fit one another or the shard, or variants as
            ``context_parallel_attention`` refuses them.
    """
    batch, heads, length, _ = q.shape
    _check(q, latent, k_rot, weight, value_dim, cp_shard)
    scale = _check_variants(q, scale, window, softcap, sinks)
    dtype = compute_dtype(q, latent, k_rot)
    q, compressed = q.to(dtype), torch.cat([latent, k_rot], dim=-1).to(dtype)
    weight = weight.to(dtype)
    if batch * length == 0:
        return q.new_empty((batch, heads, length, value_dim))
    exchange, keys, per_round = _exchange(cp_shard, batch, length, window, q, value_dim)
    autocast = torch.is_autocast_enabled(q.device.type)
    # Autocast would cast the kernels' einsums in the forward and not in the backward (as in
    # context_parallel_attention): the inputs are in the compute dtype already.
    with torch.autocast(q.device.type, enabled=False) if autocast else contextlib.nullcontext():
        out = LatentAttention.apply(
            token_major(q),
            token_major(compressed).squeeze(1),
            weight,
            sinks,
            keys,
            exchange,
            _Dims(latent.shape[-1], q.shape[-1] - k_rot.shape[-1], value_dim, scale, softcap, per_round),
        )
    return out.view(batch, length, heads, value_dim).transpose(1, 2)


@dataclass(frozen=True)
class _Dims:
    """The fixed arguments of :class:`LatentAttention`."""

    rank: int
    """``R``: the latent's width (``kv_lora_rank``)."""
    nope: int
    """``Dn``: the key's part without rotary embedding (``qk_nope_head_dim``)."""
    value_dim: int
    """``Dv``."""
    scale: float
    softcap: float | None
    per_round: int
    """Heads expanded per round."""


def _exchange(
    shard: CPShard | None, batch: int, length: int, window: int | None, q: Tensor, value_dim: int
) -> tuple[GroupExchange, KeySelection, int]:
    """The exchange, key selection and heads per round of :func:`latent_attention`: the shard's CP group
    and its rounds under CP, else one rank's keys in place and every head at once."""
    heads = q.shape[1]
    if shard is None:
        return GroupExchange(), select_row_keys(batch, length, window, q.device), heads
    keys = shard_keys(shard, window)
    if keys.order is None:
        return GroupExchange(), keys, heads
    per_head = gathered_bytes_per_head(keys.gathered_tokens, q.shape[-1], value_dim, q.element_size())
    return (
        shard.group_exchange(),
        keys,
        shard.attention.heads_per_gather(heads, per_head, shard.kv_gather_budget),
    )


class LatentAttention(torch.autograd.Function):
    """Token-major MLA attention of this rank's pieces: ``q [T_local, H, Dn + Dr]``, the latent and rotary
    part side by side ``compressed [T_local, R + Dr]``, ``weight [H * (Dn + Dv), R]`` and optional ``sinks
    [H]`` -> ``[T_local, H, Dv]``, over the keys of ``keys`` gathered through ``exchange``, expanded
    ``dims.per_round`` heads at a time. Saves only the local tensors; the backward gathers again."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        compressed: Tensor,
        weight: Tensor,
        sinks: Tensor | None,
        keys: KeySelection,
        exchange: GroupExchange,
        dims: _Dims,
    ) -> Tensor:
        q = q.contiguous()
        heads = q.shape[1]
        ordered = _ordered(compressed, keys, exchange)
        out = q.new_empty((q.shape[0], heads, dims.value_dim))
        lse = q.new_empty((heads, q.shape[0]), dtype=torch.promote_types(q.dtype, torch.float32))
        rngs = []
        for round_heads, _ in head_rounds(heads, heads, dims.per_round):
            k, v = _expand(ordered, weight, round_heads, dims)
            flash = _varlen.use_flash(q, k, v, dims.softcap)
            round_out, round_lse, rng = round_forward(
                _heads(q, round_heads), k, v, keys, dims.scale, dims.softcap, flash
            )
            del k, v
            out[:, round_heads], lse[round_heads] = round_out, round_lse
            rngs.append(rng)
        del ordered
        if sinks is not None:
            out, lse = _varlen.add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, compressed, weight, out, lse, sinks)
        ctx.keys, ctx.exchange, ctx.dims, ctx.rngs = keys, exchange, dims, rngs
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, compressed, weight, out, lse, sinks = ctx.saved_tensors
        keys, dims = ctx.keys, ctx.dims
        heads, rank, nope = q.shape[1], dims.rank, dims.nope
        ordered = _ordered(compressed, keys, ctx.exchange)
        # kv_b_proj's products run in the compute dtype (the inputs', autocast's), summed into fp32
        # (products.add_product: one bf16 GEMM on CUDA): no fp32 copy of the gathered latent, no fp32 matmul.
        compute, accumulation = weight.dtype, torch.promote_types(weight.dtype, torch.float32)
        latent = ordered[:, :rank]
        # The latent's and rotary part's gradients are added at the keys' gathered rows of the buffer the
        # reduce-scatter sums: no sequence-order copy beside it.
        rows_of_full = ordered.shape[0] if keys.order is None else keys.gathered_tokens
        full = ordered.new_zeros((rows_of_full, ordered.shape[1]), dtype=accumulation)
        dq = torch.empty_like(q)
        # kv_b_proj's rows, head by head: [H, Dn + Dv, R].
        rows = weight.view(heads, -1, rank)
        d_rows = weight.new_zeros((heads, nope + dims.value_dim, rank), dtype=accumulation)
        for index, (round_heads, _) in enumerate(head_rounds(heads, heads, dims.per_round)):
            k, v = _expand(ordered, weight, round_heads, dims)
            dq[:, round_heads], dk, dv = round_backward(
                _heads(dout, round_heads),
                _heads(q, round_heads),
                k,
                v,
                _heads(out, round_heads),
                lse[round_heads].contiguous(),
                keys,
                dims.scale,
                dims.softcap,
                ctx.rngs[index],
            )
            del k, v
            # [dK_nope, dV] of each head, in the layout of kv_b_proj's output rows, in the matmul dtype.
            d_expanded = torch.cat([dk[..., :nope].to(compute), dv.to(compute)], dim=-1).flatten(1)
            d_latent = full.new_zeros((d_expanded.shape[0], rank))
            products.add_product(d_latent, d_expanded, rows[round_heads].flatten(0, 1))
            _add_at(full[:, :rank], keys, d_latent)
            _add_at(full[:, rank:], keys, dk[..., nope:].sum(1))
            products.add_product(d_rows[round_heads].view(-1, rank), d_expanded.T, latent)
            del dk, dv, d_expanded, d_latent
        del ordered, latent
        d_compressed = (full if keys.order is None else ctx.exchange.reduce_scatter(full)).to(
            compressed.dtype
        )
        dsinks = _varlen.sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return dq, d_compressed, d_rows.view(weight.shape).to(weight.dtype), dsinks, None, None, None


def _ordered(compressed: Tensor, keys: KeySelection, exchange: GroupExchange) -> Tensor:
    """``[K, R + Dr]``: the latent and rotary part of the keys this rank's pieces read, in sequence order:
    one all-gather over ``exchange``, then ``keys.order`` (this rank's own rows without an order)."""
    if keys.order is None:
        return compressed
    return exchange.all_gather(compressed).index_select(0, keys.order)


def _expand(ordered: Tensor, weight: Tensor, heads: slice, dims: _Dims) -> tuple[Tensor, Tensor]:
    """Keys ``[K, h, Dn + Dr]`` and values ``[K, h, Dv]`` of the round's ``heads`` from the ordered latent
    and rotary part ``[K, R + Dr]``: ``[latent @ W_k[h]^T, k_rot]`` and ``latent @ W_v[h]^T``, as the layer's
    ``kv_b_proj`` expands them (the rotary part broadcast to every head)."""
    rank, nope = dims.rank, dims.nope
    rows = weight.view(-1, nope + dims.value_dim, rank)[heads]
    expanded = F.linear(ordered[:, :rank], rows.flatten(0, 1)).view(ordered.shape[0], rows.shape[0], -1)
    rotary = ordered[:, None, rank:].expand(-1, rows.shape[0], -1)
    return torch.cat([expanded[..., :nope], rotary], dim=-1), expanded[..., nope:]


def _add_at(full: Tensor, keys: KeySelection, gradient: Tensor) -> None:
    """Add the ordered keys' ``gradient`` ``[K, d]`` at their gathered rows of ``full`` (their own rows without
    an order)."""
    if keys.order is None:
        full += gradient
    else:
        full.index_add_(0, keys.order, gradient)


def _check(
    q: Tensor, latent: Tensor, k_rot: Tensor, weight: Tensor, value_dim: int, shard: CPShard | None
) -> None:
    batch, heads, length, dim = q.shape
    rank, rope = latent.shape[-1], k_rot.shape[-1]
    if latent.shape[:3] != (batch, 1, length) or k_rot.shape[:3] != (batch, 1, length) or rope >= dim:
        raise ValueError(
            f"latent must be [B, 1, S_local, R] and k_rot [B, 1, S_local, Dr] with Dr < D for q [B, H, S_local, "
            f"D] = {tuple(q.shape)}; got latent {tuple(latent.shape)}, k_rot {tuple(k_rot.shape)}."
        )
    if weight.shape != (heads * (dim - rope + value_dim), rank):
        raise ValueError(
            f"weight (kv_b_proj.weight) must be [H * (Dn + Dv), R] = [{heads} * ({dim - rope} + {value_dim}), "
            f"{rank}]; got {tuple(weight.shape)}."
        )
    if shard is not None and shard.local_tokens != batch * length:
        raise ValueError(
            f"cp_shard describes {shard.local_tokens} local tokens but q holds B * S_local = {batch} * {length}; "
            "pass the shard of the batch these tensors come from."
        )
