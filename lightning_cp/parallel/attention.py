"""Context-parallel causal attention, without TransformerEngine, for padded and packed batches.

Each CP rank holds the queries, keys and values of its own tokens in the load-balanced layout made by
:func:`lightning_cp.parallel.shard_batch` (chunks ``r`` and ``2 * cp - 1 - r`` of every sequence). Keys
and values are all-gathered over the CP group (one collective for both, only the key/value heads: with
grouped-query attention that is ``Hkv``, not ``Hq``, heads). The batch's
:class:`~lightning_cp.parallel.CPShard` then picks, for each local chunk of each sequence (a
*piece*), the keys of that sequence up to the chunk's end, and a variable-length causal kernel attends
piece by piece (:mod:`lightning_cp.parallel._varlen`: FlashAttention-2 varlen on CUDA, an exact
blocked torch kernel elsewhere). Documents of a packed batch never see each other, and no
``[T_local, T_total]`` mask is ever built.

Memory: the gathered keys and values live only inside the forward and the backward of a layer. The
backward all-gathers them again instead of keeping them, so a layer saves ``O(T_local)`` (its local
``q``, ``k``, ``v``, output and log-sum-exp), and returns dK, dV to their owners with one
reduce-scatter (an all-reduce on gloo, which has none).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_cp.parallel import _varlen
from lightning_cp.parallel.layout import ProcessGroup
from lightning_cp.parallel.sharding import CPShard


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cp_shard: CPShard | None = None,
    cp_group: ProcessGroup | None = None,
    scale: float | None = None,
) -> Tensor:
    """Causal attention over the whole sequences while each rank holds only its shard.

    Args:
        q: ``[B, Hq, S_local, D]``, this rank's queries in ``shard_batch``'s layout (any float dtype).
        k, v: ``[B, Hkv, S_local, D]`` with ``Hkv`` dividing ``Hq`` (grouped- or multi-query attention
            when smaller); same dtype and device as ``q``.
        cp_shard: the batch's ``batch["cp_shard"]`` from :func:`~lightning_cp.parallel.shard_batch`.
            Required under CP and for packed batches; without it (and without CP) every row is one
            sequence and this is plain causal attention over the local tokens.
        cp_group: the context-parallel group (``strategy.layout.cp_group``); ``None``: no CP.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``[B, Hq, S_local, D]``: the attention output of this rank's queries, in ``q``'s dtype.

    Communication: one all-gather of K and V over ``cp_group`` in the forward; in the backward the same
    all-gather again and one reduce-scatter (NCCL) or all-reduce (gloo) of their gradients.

    Raises:
        ValueError: on inconsistent shapes, a shard of another CP split than ``cp_group``'s, or CP
            without a shard.
    """
    cp_size, cp_rank = _group_coordinates(cp_group)
    batch, heads, local_len, dim = _check_shapes(q, k, v)
    scale = dim**-0.5 if scale is None else float(scale)
    if cp_shard is None:
        if cp_size > 1:
            raise ValueError(
                f"context_parallel_attention over a CP group of {cp_size} ranks needs the batch's shard: pass "
                "cp_shard=batch['cp_shard'] (set by shard_batch / MegatronCPStrategy)."
            )
        return _causal_rows(q, k, v, scale)
    split = cp_shard.split
    if (split.cp_size, split.cp_rank) != (cp_size, cp_rank):
        raise ValueError(
            f"cp_shard was made for CP rank {split.cp_rank} of {split.cp_size}, but this is rank {cp_rank} "
            f"of cp_group's {cp_size}; shard the batch with the group's size and rank."
        )
    if cp_shard.local_tokens != batch * local_len:
        raise ValueError(
            f"cp_shard describes {cp_shard.local_tokens} local tokens but q holds B * S_local = "
            f"{batch} * {local_len}; pass the shard of the batch these tensors come from."
        )
    if cp_size == 1 and cp_shard.num_sequences == batch:
        return _causal_rows(q, k, v, scale)  # one sequence per row, all local: the fused causal kernel
    if batch * local_len == 0:
        return torch.empty_like(q)

    def tokens(x: Tensor) -> Tensor:  # [B, H, S, D] -> [B * S, H, D]
        return x.transpose(1, 2).reshape(batch * local_len, x.shape[1], dim)

    out = _CPAttention.apply(tokens(q), tokens(k), tokens(v), cp_shard, GroupExchange(cp_group), scale)
    return out.view(batch, local_len, heads, dim).transpose(1, 2)


def _group_coordinates(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            "q must be [B, Hq, S_local, D] and k, v [B, Hkv, S_local, D]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    batch, heads, local_len, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != batch or k.shape[2] != local_len or k.shape[3] != dim or heads % kv_heads:
        raise ValueError(
            f"k, v {tuple(k.shape)} do not fit q {tuple(q.shape)}: they need the same B, S_local and D, and "
            f"their head count ({kv_heads}) must divide q's ({heads})."
        )
    return batch, heads, local_len, dim


def _causal_rows(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Plain causal attention of each row over its own tokens (no CP: the row is the whole sequence)."""
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def _pieces(shard: CPShard) -> _varlen.Pieces:
    """Host-side ``(q_start, q_stop, k_start, k_stop)`` of every piece, from the CPU chunk lengths."""
    kept = shard.split.kept_chunks
    pieces, q0, k0 = [], 0, 0
    for chunk in shard.chunk_lengths.tolist():
        for global_chunk in kept:
            keys = (global_chunk + 1) * chunk
            pieces.append((q0, q0 + chunk, k0, k0 + keys))
            q0, k0 = q0 + chunk, k0 + keys
    return pieces


class GroupExchange:
    """How the CP ranks exchange keys and values: collectives over ``group`` (``None``: one rank).

    :class:`_CPAttention` only talks to its peers through these two methods, so a benchmark can stand in
    for the peers on one device (``benchmarks/attention.py``).
    """

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def all_gather(self, local: Tensor) -> Tensor:
        """``[cp * T_local, ...]``: every rank's ``local`` ``[T_local, ...]``, in rank order."""
        if self.group is None:
            return local
        gathered = local.new_empty((dist.get_world_size(self.group) * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(gathered, local.contiguous(), group=self.group)
        return gathered

    def reduce_scatter(self, full: Tensor) -> Tensor:
        """This rank's ``[T_local, ...]`` slice of the sum over ranks of ``full`` ``[cp * T_local, ...]``."""
        if self.group is None:
            return full
        size = dist.get_world_size(self.group)
        local = full.shape[0] // size
        if dist.get_backend(self.group) == "nccl":
            out = full.new_empty((local, *full.shape[1:]))
            dist.reduce_scatter_single(out, full, group=self.group)
            return out
        # gloo has no reduce-scatter: all-reduce, then keep this rank's slice (twice the traffic).
        dist.all_reduce(full, group=self.group)
        rank = dist.get_rank(self.group)
        return full[rank * local : (rank + 1) * local].clone()


def _pieces_keys(kv: Tensor, shard: CPShard, exchange: GroupExchange) -> tuple[Tensor, Tensor]:
    """Every piece's keys and values ``[K, Hkv, D]`` from this rank's ``kv`` ``[T_local, 2 * Hkv, D]``."""
    keys = exchange.all_gather(kv).index_select(0, shard.key_index)
    kv_heads = kv.shape[1] // 2
    return keys[:, :kv_heads], keys[:, kv_heads:]


def _return_to_owners(grad: Tensor, shard: CPShard, exchange: GroupExchange, local: int) -> Tensor:
    """Sum the pieces' key gradients ``[K, ...]`` into the ``[T_local, ...]`` of the ranks owning the keys."""
    size = shard.split.cp_size
    full = grad.new_zeros((size * local, *grad.shape[1:]))
    full.index_add_(0, shard.key_index, grad)
    return exchange.reduce_scatter(full)


class _CPAttention(torch.autograd.Function):
    """Token-major CP attention: ``q [T_local, Hq, D]``, ``k, v [T_local, Hkv, D]`` -> ``[T_local, Hq, D]``.

    Saves only the local tensors; the backward exchanges the keys and values again.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        shard: CPShard,
        exchange: GroupExchange,
        scale: float,
    ) -> Tensor:
        piece_k, piece_v = _pieces_keys(torch.cat([k, v], dim=1), shard, exchange)
        q = q.contiguous()
        if _varlen.flash_available(q):
            out, lse, rng = _varlen.flash_forward(
                q,
                piece_k,
                piece_v,
                shard.cu_queries,
                shard.cu_keys,
                shard.max_queries,
                shard.max_keys,
                scale,
            )
        else:
            out, lse = _varlen.torch_forward(q, piece_k, piece_v, _pieces(shard), scale)
            rng = None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.exchange, ctx.scale, ctx.rng = shard, exchange, scale, rng
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        shard, scale = ctx.shard, ctx.scale
        piece_k, piece_v = _pieces_keys(torch.cat([k, v], dim=1), shard, ctx.exchange)
        if ctx.rng is not None:
            dq, dk, dv = _varlen.flash_backward(
                dout,
                q,
                piece_k,
                piece_v,
                out,
                lse,
                shard.cu_queries,
                shard.cu_keys,
                shard.max_queries,
                shard.max_keys,
                scale,
                ctx.rng,
            )
        else:
            dq, dk, dv = _varlen.torch_backward(dout, q, piece_k, piece_v, out, lse, _pieces(shard), scale)
        del piece_k, piece_v
        kv_heads = k.shape[1]
        dkv = _return_to_owners(torch.cat([dk, dv], dim=1), shard, ctx.exchange, q.shape[0])
        return dq, dkv[:, :kv_heads], dkv[:, kv_heads:], None, None, None
