"""The top-k keys a lightning indexer selects for each query, over whole sequences while each rank holds its shard.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5, and the families built like them) puts a small *lightning
indexer* before each sparse attention layer: every query scores every earlier key of its sequence,

    score[t, j] = sum_h  w[t, h] * act(scale * q[t, h] . k[j])

(``H_i`` indexer heads of ``D_i`` dims, one indexer key per token shared by the heads, ``act`` a ReLU), and the
attention reads only the ``topk`` keys of highest score. Under context parallelism a rank holds two chunks of
every sequence, so the indexer on its own tokens would pick from the wrong set. :func:`select_topk_keys`
all-gathers the indexer keys (one head of ``D_i`` dims per token: a small fraction of the attention's K/V)
and scores this rank's queries against every earlier key of their own sequence (packed documents never see
each other), in bounded blocks with a running top-k: no ``[T_local, T]`` score matrix exists.

Selected keys are returned as *rows in sequence order*: the rows of the batch's sequences, each padded to its
``2 * cp`` chunks, one after the other (:meth:`CPShard.sequence_order
<lightning_cp.parallel.CPShard.sequence_order>`); that is where :func:`~lightning_cp.parallel.sparse_attention.
sparse_attention` finds the gathered keys and values. A query with fewer earlier keys than ``topk`` selects
them all (the rest of its row is ``-1``): the unsharded model's ``topk`` picks masked positions there, which
its mask then hides, so the keys attended are the same.

Ties: keys of exactly equal score at the ``topk``-th place are ordered as ``torch.topk`` orders them, which
``torch`` leaves unspecified (and which also depends on how the candidates were blocked), so a tie there may
select another of the tied keys than the unsharded model does. Every other selection is the same set.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_cp.parallel.offsets import starts
from lightning_cp.parallel.shard import CPShard

SCORE_BLOCK_BYTES = 64 * 2**20
"""Bytes of one block of indexer scores (fp32, every indexer head): the bound on the selection's working memory
besides the gathered indexer keys and the running top-k (``[T_local, topk]`` values and rows)."""
ROWS_DTYPE = torch.int64
"""The dtype of the selected rows: the result's and the running top-k's."""


def score_block_tokens(heads: int) -> int:
    """Queries per block of the selection, and keys per block of a query block's scores: the side ``b`` of the
    ``[b, heads, b]`` fp32 scores that fit :data:`SCORE_BLOCK_BYTES` (at least 1). Read when called, so the
    memory plan (:mod:`lightning_cp.plan.sparse`) counts the blocks this module runs."""
    return max(1, math.isqrt(SCORE_BLOCK_BYTES // (4 * heads)))


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

    Scores are computed in fp32 as the models compute them: ``sum_h w[t, h] * relu(scale * q[t, h] . k[j])``,
    over the keys ``j`` of the query's own sequence at or before it.

    Returns:
        ``[T_local, n]`` int64 with ``n = min(topk, longest sequence)``: each query's selected keys as rows in
        sequence order (:func:`sequence_rows`), ``-1``
        where it has fewer than ``n`` keys.

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
    gathered = shard.group_exchange().all_gather(keys).index_select(0, shard.sequence_order()).float()
    device_first = shard.device_index(starts(lengths))[shard.sequence_index]
    device_row = device_first + shard.token_offset
    block = score_block_tokens(queries.shape[1])
    for start in range(0, local, block):
        stop = min(start + block, local)
        best, best_rows = _best_keys(
            queries[start:stop].float(),
            weights[start:stop].float(),
            gathered,
            (device_first[start:stop], device_row[start:stop]),
            (int(first[start:stop].min()), int(row[start:stop].max()) + 1),
            width,
            scale,
            block,
        )
        selected[start:stop, : best.shape[1]] = best_rows.masked_fill(best == float("-inf"), -1)
    return selected


def _best_keys(
    queries: Tensor,
    weights: Tensor,
    keys: Tensor,
    bounds: tuple[Tensor, Tensor],
    span: tuple[int, int],
    width: int,
    scale: float,
    block: int,
) -> tuple[Tensor, Tensor]:
    """The running top-``width`` of one block of queries over the key rows ``span`` in blocks of ``block``:
    scores ``[b, <= width]`` (``-inf`` for keys outside a query's ``bounds``: its sequence's first row to its
    own) and their rows."""
    first, last = bounds
    best = queries.new_empty((queries.shape[0], 0))
    best_rows = torch.empty((queries.shape[0], 0), dtype=ROWS_DTYPE, device=queries.device)
    for start in range(span[0], span[1], block):
        stop = min(start + block, span[1])
        rows = torch.arange(start, stop, dtype=ROWS_DTYPE, device=queries.device)
        # [b, H, D] x [k, D] -> [b, H, k]: the models' matmul, activation, then the weighted sum over heads.
        scores = torch.relu(torch.matmul(queries, keys[start:stop].T) * scale)
        scores = torch.matmul(weights.unsqueeze(1), scores).squeeze(1)
        visible = (rows >= first[:, None]) & (rows <= last[:, None])
        candidates = torch.cat([best, scores.masked_fill(~visible, float("-inf"))], dim=1)
        candidate_rows = torch.cat([best_rows, rows.expand(len(queries), -1)], dim=1)
        best, taken = candidates.topk(min(width, candidates.shape[1]), dim=1)
        best_rows = candidate_rows.gather(1, taken)
    return best, best_rows


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
