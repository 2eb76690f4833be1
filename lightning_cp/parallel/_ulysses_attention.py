"""CP attention by Ulysses' all-to-all: every token of some heads instead of some tokens of every head.

One all-to-all over the CP group gives each rank every token of the batch's sequences (in sequence order,
each padded to its ``2 * cp`` chunks) for ``Hq / cp`` query heads and the key/value heads they read
(replicated on several ranks when ``Hkv < cp``, as DeepSpeed's Ulysses does:
:func:`~lightning_cp.parallel.head_parallel.shared_heads`). Each rank then holds its heads' whole sequences,
keys and values included, and runs one rank's attention on them
(:func:`~lightning_cp.parallel._allgather_attention.local_attention`, the best single-device kernel), and
one all-to-all brings the output back to the tokens' owners (:mod:`lightning_cp.parallel.head_parallel`).
"""

from __future__ import annotations

from torch import Tensor

from lightning_cp.parallel._allgather_attention import local_attention, token_major
from lightning_cp.parallel.head_parallel import (
    head_slices,
    shared_heads,
    to_heads,
    to_tokens,
    whole_sequences,
)
from lightning_cp.parallel.shard import CPShard


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: CPShard,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """CP attention of this rank's ``q`` ``[B, Hq, S_local, D]`` and ``k``, ``v`` ``[B, Hkv, S_local, D /
    Dv]`` through the head-parallel exchange: ``[B, Hq, S_local, Dv]``.

    Arguments as :func:`~lightning_cp.parallel.context_parallel_attention` takes them (checked, one dtype);
    ``Hq`` and ``Hkv`` split over the shard's CP group
    (:meth:`AttentionMode.ulysses <lightning_cp.parallel.attention_mode.AttentionMode.ulysses>`).

    Communication: one all-to-all of q, k, v over the shard's CP group to the heads and one of the output
    back in the forward; the same two, of their gradients, in the backward.
    """
    batch, heads, local_len, _ = q.shape
    rank = shard.split.cp_rank
    query_heads = head_slices(heads, shard.split.cp_size, "query heads")
    kv_heads = shared_heads(query_heads, heads, k.shape[1], "key/value heads")

    def rows(x: Tensor) -> Tensor:  # [T_seq, h, d] -> [1, h, T_seq, d]: the sequences as one packed row
        return x.transpose(0, 1).unsqueeze(0)

    qs, ks, vs = to_heads(
        shard, (token_major(q), query_heads), (token_major(k), kv_heads), (token_major(v), kv_heads)
    )
    own_sinks = None if sinks is None else sinks.index_select(0, shard.device_index(query_heads[rank]))
    out = local_attention(
        rows(qs), rows(ks), rows(vs), whole_sequences(shard), scale, window, softcap, own_sinks
    )
    out = to_tokens(shard, out[0].transpose(0, 1))  # [T_local, Hq, Dv]
    return out.reshape(batch, local_len, heads, -1).transpose(1, 2)
