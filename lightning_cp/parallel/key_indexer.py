"""The top-k keys a lightning indexer selects for each query, over whole sequences while each rank holds its shard.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, and the families built like them) puts a small *lightning
indexer* before each sparse attention layer: every query scores every earlier key of its sequence,

    score[t, j] = sum_h  w[t, h] * act(scale * q[t, h] . k[j])

(``H_i`` indexer heads of ``D_i`` dims, one indexer key per token shared by the heads, ``act`` a ReLU), and the
attention reads only the ``topk`` keys of highest score. Under context parallelism a rank holds two chunks of
every sequence, so the indexer on its own tokens would pick from the wrong set. :func:`select_topk_keys`
all-gathers the indexer keys (one head of ``D_i`` dims per token: a small fraction of the attention's K/V)
and scores this rank's queries against every earlier key of their own sequence (packed documents never see
each other), a block of queries at a time: one :func:`indexer_scores` call scores the block over its whole
span of keys (a custom op: one Triton launch on CUDA, :mod:`lightning_cp.parallel._indexer_triton`), one
``topk`` selects. The operators per block do not grow with the span, and no ``[T_local, T]`` score matrix
exists (a block's ``[b, span]`` scores fit :data:`SCORE_BLOCK_BYTES`).

Selected keys are returned as *rows in sequence order*: the rows of the batch's sequences, each padded to its
``2 * cp`` chunks, one after the other (:meth:`CPShard.sequence_order
<lightning_cp.parallel.CPShard.sequence_order>`); that is where :func:`~lightning_cp.parallel.sparse_attention.
sparse_attention` finds the gathered keys and values. A query with fewer earlier keys than ``topk`` selects
them all (the rest of its row is ``-1``): the unsharded model's ``topk`` picks masked positions there, which
its mask then hides, so the keys attended are the same.

Ties: keys of exactly equal score at the ``topk``-th place are ordered as ``torch.topk`` orders them, which
``torch`` leaves unspecified (and which also depends on the order the products were summed in), so a tie there
may select another of the tied keys than the unsharded model does. Every other selection is the same set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from lightning_cp.parallel.offsets import starts
from lightning_cp.parallel.shard import CPShard

SCORE_BLOCK_BYTES = 256 * 2**20
"""Bytes of one block of queries' indexer scores (fp32 ``[b, keys]``): the bound on the selection's working memory
besides the gathered indexer keys and the result. The torch path's per-head products of a block (fp32 ``[b, H_i,
k]``) are bounded by it too."""
ROWS_DTYPE = torch.int64
"""The dtype of the selected rows (``torch.topk``'s)."""


def query_block_tokens(keys: int) -> int:
    """Queries per block of the selection: the ``b`` whose fp32 scores over ``keys`` keys (the gathered sequence
    order, the longest span a block can read) fit :data:`SCORE_BLOCK_BYTES` (at least 1). Read when called, so
    the memory plan (:mod:`lightning_cp.plan.sparse`) counts the blocks this module runs."""
    return max(1, SCORE_BLOCK_BYTES // (4 * max(1, keys)))


def key_block_tokens(queries: int, heads: int) -> int:
    """Keys per step of the torch path's loop over a block of ``queries``: its ``[queries, heads, k]`` fp32
    per-head products fit :data:`SCORE_BLOCK_BYTES` (at least 1). The Triton kernel holds none."""
    return max(1, SCORE_BLOCK_BYTES // (4 * heads * max(1, queries)))


@torch.no_grad()
def select_topk_keys(
    queries: Tensor,
    weights: Tensor,
    keys: Tensor,
    shard: CPShard,
    topk: int,
    scale: float,
) -> Tensor:
    """The ``topk`` earlier keys of highest indexer score for each of this rank's queries.

    Args:
        queries: ``[T_local, H_i, D_i]``, this rank's indexer queries (the model's rotary embedding applied),
            tokens in the batch's row-major order.
        weights: ``[T_local, H_i]``, each query's per-head weights (every constant factor of the model
            included).
        keys: ``[T_local, D_i]``, this rank's indexer keys (one per token, shared by the heads).
        shard: the batch's :class:`~lightning_cp.parallel.CPShard`; its CP group is all-gathered over.
        topk: the model's ``index_topk``.
        scale: the factor inside the activation (the model's ``softmax_scale``).

    The scores are the models' ``sum_h w[t, h] * relu(scale * q[t, h] . k[j])`` over the keys ``j`` of the
    query's own sequence at or before it, computed by :func:`indexer_scores` for a block of queries at a time
    (:func:`query_block_tokens`), each block's top-k taken at once. Products of the inputs' dtype summed in fp32:
    for bf16 queries and keys that is what the models' fp32 matmul of their upcast copies computes (a product of
    two bf16 values is exact in fp32), on a GPU at bf16's speed. Under autocast the queries, keys and weights are
    cast to autocast's dtype and the scores rounded to it where the models' autocast matmuls round them.

    Returns:
        ``[T_local, n]`` int64 with ``n = min(topk, longest sequence)``: each query's selected keys as rows in
        sequence order (:func:`sequence_rows`), ``-1`` where it has fewer than ``n`` keys.

    Communication: one all-gather of ``keys`` over the shard's CP group (``[cp * T_local, D_i]``); none without
    CP. No gradient (the models select under ``torch.no_grad``).
    """
    local = queries.shape[0]
    row, first = sequence_rows(shard)  # on the CPU: each query block's span of keys without a device sync
    lengths = shard.sequence_lengths
    longest = int(lengths.max()) if shard.num_sequences else 0
    width = min(topk, longest)
    selected = torch.full((local, width), -1, dtype=ROWS_DTYPE, device=queries.device)
    if local == 0 or width == 0:
        return selected
    rounding = _autocast_dtype(queries.device)
    # What the models' matmul reads: autocast's dtype, else both upcast to the wider of the two.
    dtype = rounding or torch.promote_types(queries.dtype, keys.dtype)
    queries, keys = queries.to(dtype), keys.to(dtype)
    if rounding is not None:
        weights = weights.to(rounding)
    gathered = shard.group_exchange().all_gather(keys).index_select(0, shard.sequence_order())
    device_first = shard.device_index(starts(lengths))[shard.sequence_index]
    device_row = device_first + shard.token_offset
    block = query_block_tokens(gathered.shape[0])
    for start in range(0, local, block):
        stop = min(start + block, local)
        lo, hi = int(first[start:stop].min()), int(row[start:stop].max()) + 1
        scores = indexer_scores(
            queries[start:stop],
            weights[start:stop],
            gathered[lo:hi],
            device_first[start:stop] - lo,
            device_row[start:stop] - lo,
            scale,
            rounding,
        )
        best, taken = scores.topk(min(width, hi - lo), dim=1)
        selected[start:stop, : best.shape[1]] = (taken + lo).masked_fill_(best == float("-inf"), -1)
    return selected


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    """Autocast's dtype on ``device``'s type when it is enabled there, else ``None``."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


@torch.library.custom_op("lightning_cp::indexer_scores", mutates_args=())
def indexer_scores(
    queries: Tensor,
    weights: Tensor,
    keys: Tensor,
    first: Tensor,
    last: Tensor,
    scale: float,
    rounding: torch.dtype | None,
) -> Tensor:
    """One block's indexer scores ``sum_h w[t, h] * relu(scale * q[t, h] . k[j])``, ``-inf`` where key ``j`` is
    not one of query ``t``'s (``first[t] <= j <= last[t]``).

    Args:
        queries: ``[b, H_i, D_i]``; weights: ``[b, H_i]``; keys: ``[k, D_i]`` (the queries' dtype).
        first, last: ``[b]`` int64, each query's first and last key (rows of ``keys``).
        scale: the factor inside the activation.
        rounding: ``None``, or the dtype the products (then their scaled value), the weights and the weighted sum
            are rounded to, as the models' matmuls under autocast round them.

    Returns:
        ``[b, k]`` fp32. Products in the inputs' dtype summed in fp32 (fp32 inputs: full fp32, no TF32).
        On CUDA one launch of the Triton kernel (:mod:`lightning_cp.parallel._indexer_triton`), which skips the
        tiles no query sees; elsewhere a loop over ``key_block_tokens`` keys. No communication.
    """
    return _torch_scores(queries, weights, keys, first, last, scale, rounding)


def _torch_scores(
    queries: Tensor,
    weights: Tensor,
    keys: Tensor,
    first: Tensor,
    last: Tensor,
    scale: float,
    rounding: torch.dtype | None,
) -> Tensor:
    """:func:`indexer_scores` in torch: fp32 copies (bf16 products are exact in fp32), ``key_block_tokens`` keys
    a step."""
    b, heads, _ = queries.shape
    out = queries.new_empty((b, keys.shape[0]), dtype=torch.float32)
    rows = torch.arange(keys.shape[0], device=keys.device)
    step = key_block_tokens(b, heads)
    with torch.autocast(queries.device.type, enabled=False):
        q, w = queries.float(), _rounded(weights.float(), rounding)[:, None, :]
        for start in range(0, keys.shape[0], step):
            stop = min(start + step, keys.shape[0])
            products = _rounded(torch.matmul(q, keys[start:stop].float().T), rounding)  # [b, H, k]
            products = torch.relu_(_rounded(products.mul_(scale), rounding))
            scores = _rounded(torch.matmul(w, products).squeeze(1), rounding)
            visible = (rows[start:stop] >= first[:, None]) & (rows[start:stop] <= last[:, None])
            out[:, start:stop] = scores.masked_fill_(~visible, float("-inf"))
    return out


def _rounded(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    return x if dtype is None else x.to(dtype).float()


@indexer_scores.register_fake
def _fake_scores(queries: Tensor, weights: Tensor, keys: Tensor, *_: object) -> Tensor:
    return queries.new_empty((queries.shape[0], keys.shape[0]), dtype=torch.float32)


@indexer_scores.register_kernel("cuda")
def _cuda_scores(queries: Tensor, *args: Any) -> Tensor:
    from lightning_cp.parallel import _indexer_triton

    if _indexer_triton.available(queries):
        return _indexer_triton.scores(queries, *args)
    return _torch_scores(queries, *args)


@register_flop_formula(torch.ops.lightning_cp.indexer_scores)
def _flops(
    queries_shape: torch.Size, weights_shape: torch.Size, keys_shape: torch.Size, *_: object, **__: object
) -> int:
    """Every (query, key) pair's products and the weighted sum over the heads: ``2 b H_i k (D_i + 1)``."""
    b, heads, dim = queries_shape
    return 2 * b * heads * keys_shape[0] * (dim + 1)


def sequence_rows(shard: CPShard) -> tuple[Tensor, Tensor]:
    """``(row, first)``, each ``[T_local]`` int64 on the CPU: the row in sequence order
    (:meth:`CPShard.sequence_order`'s numbering) of every local token of ``shard``, and the row of its
    sequence's first token. From the chunk lengths alone (no device synchronization), the same on every rank
    for the same token; once per batch (:meth:`CPShard.cached`)."""
    return shard.cached(_sequence_rows)


def _sequence_rows(shard: CPShard) -> tuple[Tensor, Tensor]:
    lengths = shard.sequence_lengths
    sequence, offset, _ = shard.split.positions(lengths)
    first = starts(lengths)[sequence]
    return first + offset, first
