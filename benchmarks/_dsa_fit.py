"""A DSA layer's counts at a rank's real tokens, fitted from counts at token counts small enough to dispatch.

A DeepSeek Sparse Attention layer (GLM-5's) runs two loops whose iterations grow with the tokens: its indexer
(:func:`~lightning_cp.parallel.key_indexer.select_topk_keys`) scores every block of queries against every key
block up to the block's last query, (query block x key block) pairs that grow with the square of the tokens,
and the sparse attention's torch kernel runs its query blocks (``sparse_attention.query_block``), which grow
with them. At 1M tokens they are millions of operators per layer, too many to dispatch on fake tensors in the
benchmark's time. So the layer is counted at the real width and layout at :data:`FIT_TOKENS` tokens per rank,
and each count is fitted along the blocks the kernels' own functions give for the real tokens
(:func:`structure`): the operators region by region (``_counting.REGIONS``), the indexer's as ``a + b q +
c p`` (``q`` its query blocks, ``p`` its block pairs), the attention kernel's as ``a + b n`` (``n`` its
query blocks), the rest as ``a + b T + c tiles`` (the tiled modules' tiles: ``ceil(T / d)`` for each tiled
input width ``d``, proportional to ``T`` at multiples of 2,048 for GLM-5's 128, 512 and 2,048, and
``ceil(T / hidden)``); the FLOPs and bytes as ``a T + b k`` (``k`` the (query, key) pairs the indexer
scores, blocks whole). :data:`CHECK_TOKENS`, counted too, holds the fit to a count it was not fitted on.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from _counting import Counts, count_layer

FIT_TOKENS = (4096, 6144, 8192)
"""Tokens per rank the layer is counted at and fitted on: multiples of 2,048 above the top-k width at one GPU
(so the attention's query block is the real one) and above 2,048 (a module tiled at 2,048 wide runs a single
tile with fewer operators), with 1 and 2 tiles of the hidden width."""
CHECK_TOKENS = 14336
"""Tokens per rank of the count that checks the fit: beyond the fitted ones in every term (3 tiles of the
hidden width; a single tile there runs 11 operators fewer than the next ones, so the fit's per-tile
operators are 11 too many: ~0.004% of GLM-5's operators per layer at 1M tokens)."""


@dataclass(frozen=True)
class Structure:
    """The loop iterations of one DSA layer on one CP rank of ``T`` tokens, from the kernels' functions."""

    tokens: int
    attention_blocks: int
    """The sparse attention's blocks (``query_block``): its queries over the top-k width, in rounds."""
    indexer_blocks: int
    """The indexer's query blocks (``score_block_tokens``)."""
    indexer_pairs: int
    """The indexer's (query block x key block) pairs."""
    indexer_keys: int
    """The (query, key) pairs the indexer scores, each block pair whole."""
    tiles: int
    """``ceil(T / hidden)`` (the tiled MLP's tiles), 0 without ``+tiled``."""


def structure(shape: Any, layout: Any, tokens: int) -> Structure:
    """:class:`Structure` of rank 0 of ``layout``'s CP group holding ``tokens`` of one sequence of
    ``cp * tokens`` (``shape``: the model's :class:`~lightning_cp.plan.ModelShape`)."""
    from lightning_cp.parallel import shard_batch
    from lightning_cp.parallel.key_indexer import score_block_tokens, sequence_rows
    from lightning_cp.parallel.simulated import SimulatedCPGroup
    from lightning_cp.parallel.sparse_attention import query_block

    cp = layout.cp
    width = min(shape.sparse.topk, tokens * cp)
    if shape.latent_dim is not None:  # MLA's absorbed form: one latent key read by every head
        rounds, per_round, dims = 1, 1, shape.latent_dim
    else:
        per_round = layout.mode().kv_heads_per_gather or shape.kv_heads
        rounds, dims = shape.kv_heads // per_round, shape.head_dim + shape.v_head_dim
    queries, heads = query_block(width, per_round, shape.heads // (rounds * per_round), dims)
    attention_blocks = rounds * math.ceil(tokens / queries) * math.ceil(per_round / heads)
    group = SimulatedCPGroup(cp, sum_key_gradients=False)
    ids = {"input_ids": torch.zeros(1, cp * tokens, dtype=torch.long)}
    shard = shard_batch(ids, cp, 0, cp_group=group.exchange(0), attention=layout.mode())["cp_shard"]
    row, first = sequence_rows(shard)
    block = score_block_tokens(shape.sparse.heads)
    pairs = keys = 0
    for start in range(0, tokens, block):  # select_topk_keys' loop: each query block's span of key rows
        stop = min(start + block, tokens)
        span = int(row[start:stop].max()) + 1 - int(first[start:stop].min())
        pairs += math.ceil(span / block)
        keys += (stop - start) * span
    tiles = math.ceil(tokens / shape.hidden) if layout.tiled else 0
    return Structure(tokens, attention_blocks, math.ceil(tokens / block), pairs, keys, tiles)


def _op_features(s: Structure) -> dict[str, list[float]]:
    return {
        "indexer": [1, s.indexer_blocks, s.indexer_pairs],
        "attention": [1, s.attention_blocks],
        "layer": [1, s.tokens, s.tiles],
    }


def _fit(rows: list[list[float]], values: list[float], at: list[float]) -> float:
    """Least squares of ``values`` on ``rows``, evaluated at ``at`` (float64)."""
    a = torch.tensor(rows, dtype=torch.float64)
    solution = torch.linalg.lstsq(a, torch.tensor(values, dtype=torch.float64)[:, None], driver="gelsd")
    return float(torch.tensor(at, dtype=torch.float64) @ solution.solution[:, 0])


def fit(samples: list[tuple[Structure, Counts]], at: Structure) -> Counts:
    """The counts at ``at``, fitted on ``samples`` (see the module docstring); a count ``at`` already holds
    is returned as counted."""
    for s, counts in samples:
        if s == at:
            return counts
    result = Counts()
    for region, features in _op_features(at).items():
        rows = [_op_features(s)[region] for s, _ in samples]
        result.ops_in[region] = round(_fit(rows, [c.ops_in[region] for _, c in samples], features))
    result.ops = sum(result.ops_in.values())
    rows = [[s.tokens, s.indexer_keys] for s, _ in samples]
    point = [at.tokens, at.indexer_keys]

    def fitted(get: Any) -> int:
        return max(0, round(_fit(rows, [get(c) for _, c in samples], point)))

    for name in ("flops", "flops_in", "sent"):
        keys = set().union(*(getattr(c, name) for _, c in samples))
        values = {k: fitted(lambda c, k=k, name=name: getattr(c, name)[k]) for k in keys}
        setattr(result, name, Counter(values))
    result.attention_flops = fitted(lambda c: c.attention_flops)
    result.forward_flops = fitted(lambda c: c.forward_flops)
    return result


@dataclass
class DsaFit:
    """One DSA layer's counts on one layout, fitted: :meth:`at` any tokens per rank."""

    shape: Any
    layout: Any
    samples: list[tuple[Structure, Counts]]
    check: tuple[Structure, Counts]

    def at(self, tokens: int) -> Counts:
        return fit(self.samples, structure(self.shape, self.layout, tokens))

    def check_error(self) -> tuple[float, float]:
        """The fit's relative error at :data:`CHECK_TOKENS`: operators, FLOPs."""
        s, counted = self.check
        predicted = fit(self.samples, s)
        return (
            predicted.ops / counted.ops - 1,
            predicted.total_flops / counted.total_flops - 1,
        )


def dsa_fit(config: dict[str, Any], index: int, shape: Any, layout: Any, **options: Any) -> DsaFit:
    """Count layer ``index`` of ``config`` at :data:`FIT_TOKENS` and :data:`CHECK_TOKENS` tokens per rank
    (``options``: :func:`~_counting.count_layer`'s) and fit them."""

    def sample(tokens: int) -> tuple[Structure, Counts]:
        counts = count_layer(config, index, cp=layout.cp, tokens=tokens, **options)
        return structure(shape, layout, tokens), counts

    return DsaFit(shape, layout, [sample(t) for t in FIT_TOKENS], sample(CHECK_TOKENS))
