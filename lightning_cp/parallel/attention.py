"""Context-parallel causal attention, without TransformerEngine.

Each CP rank holds the query, key and value of its own tokens in the load-balanced layout made by
:func:`lightning_cp.parallel.shard_batch` (chunks ``r`` and ``2 * cp - 1 - r`` of every sequence). Keys
and values are all-gathered over the CP group; every query then attends to the keys at or before its
position in the *full* sequence (and, in a packed batch, only within its own sequence). The backward
of the all-gather returns dK and dV to the ranks that own those tokens.

Why all-gather rather than a ring: it needs one collective per layer that works on gloo and NCCL
alike, and K/V are ``2 * heads * head_dim`` values per token, far smaller than the activations the
loss and MLP keep; the memory the package saves is the ``[tokens, vocab]`` logits.

Kernels: padded batches go through ``scaled_dot_product_attention`` with a bottom-right-aligned causal
bias per local chunk, which dispatches to the flash / memory-efficient kernels on CUDA and never builds
a mask; packed batches need a document mask, built as a ``[T_local, T_total]`` boolean (the
memory-efficient kernel takes it on CUDA; plain SDPA on CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from lightning_cp.parallel.collectives import all_gather
from lightning_cp.parallel.groups import ProcessGroup
from lightning_cp.parallel.sharding import _split_index


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor | None = None,
    cp_group: ProcessGroup | None = None,
    scale: float | None = None,
) -> Tensor:
    """Causal attention over the whole sequence while each rank holds only its shard.

    Args:
        q, k, v: ``[B, heads, S_local, head_dim]``, this rank's tokens in ``shard_batch``'s layout
            (``S_local`` even: two chunks). Any float dtype; the result has ``q``'s dtype.
        cu_seqlens: packed batches only (``B == 1``): this rank's local sequence boundaries
            ``[n + 1]`` as returned by ``shard_batch`` in ``batch["cu_seqlens"]``.
        cp_group: the context-parallel group (``lightning_cp.parallel.groups.cp_group()``); ``None`` means
            no context parallelism (plain causal attention over the local tokens).
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[B, heads, S_local, head_dim]``: the attention output of this rank's queries.

    Communication: all-gather of K and V over ``cp_group`` (forward), reduce-scatter / all-reduce of
    their gradients (backward).
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(
            "q, k, v must be [B, heads, S_local, head_dim] with the same B, heads and S_local; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
    if cp_size == 1 and cu_seqlens is None:
        # No split: plain causal attention, for any length.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    local_len = q.shape[2]
    if local_len % 2:
        raise ValueError(
            f"S_local={local_len} is odd: context-parallel attention expects the two-chunk layout of shard_batch "
            "(every sequence padded to a multiple of 2 * cp)."
        )
    if cp_size > 1:
        k = all_gather(k, 2, cp_group)
        v = all_gather(v, 2, cp_group)
    if cu_seqlens is None:
        return _padded_attention(q, k, v, cp_size, cp_rank, scale)
    if q.shape[0] != 1:
        raise ValueError(f"Packed attention (cu_seqlens given) expects B == 1, got q {tuple(q.shape)}.")
    return _packed_attention(q, k, v, cu_seqlens, cp_size, cp_rank, scale)


def _padded_attention(
    q: Tensor, k: Tensor, v: Tensor, cp_size: int, cp_rank: int, scale: float | None
) -> Tensor:
    """Each row is one sequence: reorder gathered K/V to sequence order, then two causal SDPA calls."""
    batch, heads, local_len, dim = q.shape
    chunk = local_len // 2
    if cp_size > 1:
        # Gathered chunk order is [rank0: c0, c_{2cp-1} | rank1: c1, c_{2cp-2} | ...]; put chunk g at slot g.
        g = torch.arange(2 * cp_size, device=q.device)
        slot = torch.where(g < cp_size, 2 * g, 2 * (2 * cp_size - 1 - g) + 1)
        k = k.view(batch, heads, 2 * cp_size, chunk, dim).index_select(2, slot).view(batch, heads, -1, dim)
        v = v.view(batch, heads, 2 * cp_size, chunk, dim).index_select(2, slot).view(batch, heads, -1, dim)
    outs = []
    for half, global_chunk in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        keys = (global_chunk + 1) * chunk
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, half * chunk : (half + 1) * chunk],
                k[:, :, :keys],
                v[:, :, :keys],
                attn_mask=causal_lower_right(chunk, keys),
                scale=scale,
            )
        )
    return torch.cat(outs, dim=2)


def _packed_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cp_size: int, cp_rank: int, scale: float | None
) -> Tensor:
    """Mask by (sequence, position in sequence); every rank's token positions follow from the layout."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
    padded_lengths = (cu[1:] - cu[:-1]) * cp_size
    if q.shape[2] != int(cu[-1]):
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but q holds {q.shape[2]} local tokens.")
    seq_q, pos_q, _ = _split_index(padded_lengths, cp_size, cp_rank)
    keys = [_split_index(padded_lengths, cp_size, r) for r in range(cp_size)]
    seq_k = torch.cat([s for s, _, _ in keys])
    pos_k = torch.cat([p for _, p, _ in keys])
    mask = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
