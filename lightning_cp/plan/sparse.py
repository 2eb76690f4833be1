"""Per-rank bytes of one DeepSeek Sparse Attention layer under CP: the indexer's selection and the attention over it.

The terms count what :func:`~lightning_cp.parallel.key_indexer.select_topk_keys` and
:func:`~lightning_cp.parallel.sparse_attention.sparse_attention` hold, with the block sizes and dtypes those
modules and the indexers' adapter use, read from them when called
(:func:`~lightning_cp.parallel.key_indexer.query_block_tokens`, ``key_block_tokens``,
:data:`~lightning_cp.parallel.key_indexer.ROWS_DTYPE`,
:func:`~lightning_cp.parallel.sparse_attention.query_block_tokens`,
:data:`~lightning_cp.hf.indexers.SELECTION_DTYPE`); none is restated here. ``T`` is the rank's local
tokens, ``K = cp * T`` the gathered (padded) sequence, ``n = min(topk, K)`` the keys each query attends to, ``h``
the key/value heads of one all-gather round; ``tests/plan/test_sparse.py`` and
``benchmarks/sparse_attention.py`` hold them against the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_cp.hf.indexers import SELECTION_DTYPE
from lightning_cp.parallel import key_indexer
from lightning_cp.parallel import sparse_attention as sparse_kernel
from lightning_cp.plan.shape import ModelShape


@dataclass(frozen=True)
class SparseLayerBytes:
    """One sparse attention layer's bytes on one rank, by what holds them."""

    selection: int
    """Saved until the backward: the selected keys of every local query, int32 ``[T, n]``
    (``O(T * topk)``; one per layer with a full indexer, shared layers read the same tensor)."""
    output: int
    """Saved: the attention output ``[T, Hq * Dv]`` in the compute dtype and its fp32 log-sum-exp ``[Hq, T]``."""
    indexer: int
    """The selection's forward transient: the gathered indexer keys (all-gathered, then in sequence order, in the
    compute dtype), the int64 result ``[T, n]`` and its int32 copy, and one block of ``b`` queries
    (``query_block_tokens``): its fp32 scores over the whole gathered sequence ``[b, K]`` beside either the torch
    path's step of ``k`` keys (``key_block_tokens``: ``[b, H_i, k]`` fp32 products, the step's scores and masks)
    or the block's top-k (fp32 values, int64 rows, the rows shifted and their mask). The Triton kernel holds no
    products and no fp32 copy of the queries: on a GPU the term is at most that block of products high."""
    forward: int
    """The attention forward's transient: one round's keys and values ``[K, h * (D + Dv)]`` gathered and put
    in sequence order (two copies at once, in the compute dtype), then one of them beside a block of selected
    keys or values (fp32) and its scores."""
    backward: int
    """The attention backward's transient: the incoming gradient and ``dq``, ``dk``, ``dv`` (compute dtype),
    and the largest of one round's phases: its gathered keys and values beside their fp32 gradients (added at
    their gathered rows of the buffer that is reduce-scattered) and a block, or at the round's end that
    buffer and this rank's share of the sum."""

    @property
    def peak(self) -> int:
        """The layer's peak above its inputs when it runs alone (selection, forward, backward)."""
        return max(self.indexer, self.selection + self.output + max(self.forward, self.backward))


def sparse_layer_bytes(
    shape: ModelShape, tokens: int, cp: int, heads_per_round: int, compute_bytes: int, *, latent: bool = False
) -> SparseLayerBytes:
    """The bytes of one of ``shape``'s sparse attention layers on a rank of ``tokens`` local tokens of ``cp``.

    Args:
        shape: a model with :attr:`~lightning_cp.plan.ModelShape.sparse` sizes.
        tokens: the rank's local tokens ``T`` (the sequence, padded, over ``cp``).
        cp: context-parallel size.
        heads_per_round: key/value heads all-gathered per round (``h``: all of them, or the strategies'
            ``kv_heads_per_gather``).
        compute_bytes: bytes of the compute dtype (the layer's ``q``, ``k``, ``v`` and output).
        latent: the values are the keys' first ``shape.v_head_dim`` columns (``sparse_attention(v=None)``:
            MLA's absorbed form, a shape of ``kv_heads=1`` and ``head_dim`` the latent's width, e.g. 576 with
            ``value_head_dim=512``); only the keys are gathered.

    Raises:
        ValueError: ``shape`` has no sparse attention.
    """
    sparse = shape.sparse
    if sparse is None:
        raise ValueError("sparse_layer_bytes: the model has no sparse attention (ModelShape.sparse is None).")
    gathered = tokens * cp
    width = min(sparse.topk, gathered)
    upcast = compute_bytes if compute_bytes < 4 else 0  # a compute-dtype copy made before an fp32 one
    rows_bytes = key_indexer.ROWS_DTYPE.itemsize
    selection = SELECTION_DTYPE.itemsize * tokens * width
    output = tokens * shape.out_dim * compute_bytes + 4 * shape.heads * tokens

    # The indexer: keys gathered and put in sequence order (compute dtype); blocks of queries' scores over them.
    index_keys = gathered * sparse.head_dim * compute_bytes
    queries = min(key_indexer.query_block_tokens(gathered), tokens)
    keys = min(key_indexer.key_block_tokens(queries, sparse.heads), gathered)
    upcast_queries = queries * sparse.heads * sparse.head_dim * 4 if upcast else 0
    # A step: its products, its scores, the visible mask and two comparisons, its keys in fp32; the rows.
    step = (
        4 * queries * keys * (sparse.heads + 1)
        + 3 * queries * keys
        + 4 * keys * sparse.head_dim * bool(upcast)
    )
    # The top-k: values (fp32), rows (int64), the rows shifted, the mask of the -inf ones.
    top = queries * width * (4 + 2 * rows_bytes + 1)
    block = 4 * queries * gathered + rows_bytes * gathered + upcast_queries + max(step, top)
    indexer = rows_bytes * tokens * width + max(2 * index_keys, index_keys + block, selection)

    # The attention: a round's K/V gathered and in sequence order; blocks of selected keys and values (fp32)
    # and their scores.
    value_dim = 0 if latent else shape.v_head_dim
    round_dims = heads_per_round * (shape.head_dim + value_dim)
    round_kv = gathered * round_dims * compute_bytes
    round_grads = gathered * round_dims * 4
    group = shape.heads // shape.kv_heads
    size, block_heads = sparse_kernel.query_block(width, heads_per_round, group, shape.head_dim + value_dim)
    selected = min(size, tokens) * width
    keys_side, values_side = (selected * block_heads * d for d in (shape.head_dim, value_dim))
    block_scores = 4 * selected * block_heads * group
    # The int64 rows and the mask of the selection, the keys and values gathered (in the compute dtype, then
    # fp32: one side's copy at a time), the scores and a softmax's temporary of their size.
    block_forward = (
        (rows_bytes + 1) * selected
        + 4 * (keys_side + values_side)
        + upcast * max(keys_side, values_side)
        + 2 * block_scores
    )
    forward = max(2 * round_kv, round_kv + block_forward)
    # The backward's block: the rows, mask and rows in the gathered buffer, the keys and values (fp32), the
    # values' gradient beside them, and the probabilities beside ds.
    values_grad = 4 * selected * block_heads * shape.v_head_dim
    block_backward = (
        (2 * rows_bytes + 1) * selected
        + 4 * (keys_side + values_side)
        + upcast * max(keys_side, values_side)
        + values_grad
        + 2 * block_scores
    )
    local_dims = shape.q_dim + shape.out_dim + shape.kv_dim + (0 if latent else shape.v_dim)
    local_grads = tokens * local_dims * compute_bytes
    delta = tokens * shape.out_dim * 4 * (3 if upcast else 1)
    backward = local_grads + max(
        delta,
        4 * shape.heads * tokens
        + max(2 * round_kv, round_kv + round_grads + block_backward, round_grads + round_grads // cp),
    )
    return SparseLayerBytes(
        selection=selection, output=output, indexer=indexer, forward=forward, backward=backward
    )
