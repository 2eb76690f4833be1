"""A DSA layer's counts at a rank's real tokens, fitted from counts at token counts small enough to dispatch.

A DeepSeek Sparse Attention layer (GLM-5's) runs a loop whose iterations grow with the tokens: its indexer
(:func:`~lightning_cp.parallel.key_indexer.select_topk_keys`) scores blocks of queries
(``query_block_tokens``: as many as fit a block's fp32 scores over the whole gathered sequence), each against its
span of keys in one call of ``indexer_scores`` (one Triton launch on a GPU) and one top-k. Its blocks grow with
the square of the tokens (more queries, fewer in a block as the sequence grows), and the FLOPs with the
query-key pairs: too many at 1M tokens to dispatch on fake tensors in the benchmark's time. So the layer is
counted at the real width and layout at :data:`FIT_TOKENS` tokens per rank, and each count is fitted along what
the kernels' own functions give for the real tokens (:func:`structure`): the operators region by region
(``_counting.REGIONS``, ``OP_REGIONS``), the indexer's as ``a + b q`` (``q`` its query blocks), the top-k
attention's as a constant (its Triton kernels, one custom operator a round forward and backward), the rest as
``a + b T + c tiles`` (the tiled modules' tiles: ``ceil(T / d)`` for each tiled input width ``d``, proportional
to ``T`` at multiples of 2,048 for GLM-5's 128, 512 and 2,048, and ``ceil(T / hidden)``); the FLOPs and bytes as
``a T + b k`` (``k`` the (query, key) pairs the indexer scores: each block's queries by its span).
:data:`CHECK_TOKENS`, counted too, holds the fit to a count it was not fitted on.
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
    indexer_blocks: int
    """The indexer's query blocks (``query_block_tokens``)."""
    indexer_keys: int
    """The (query, key) pairs the indexer scores: each block's queries by its span of keys."""
    tiles: int
    """``ceil(T / hidden)`` (the tiled MLP's tiles), 0 without ``+tiled``."""


def structure(shape: Any, layout: Any, tokens: int) -> Structure:
    """:class:`Structure` of rank 0 of ``layout``'s CP group holding ``tokens`` of one sequence of
    ``cp * tokens`` (``shape``: the model's :class:`~lightning_cp.plan.ModelShape`)."""
    from lightning_cp.parallel import shard_batch
    from lightning_cp.parallel.key_indexer import query_block_tokens, sequence_rows
    from lightning_cp.parallel.simulated import SimulatedCPGroup

    cp = layout.cp
    group = SimulatedCPGroup(cp, sum_key_gradients=False)
    ids = {"input_ids": torch.zeros(1, cp * tokens, dtype=torch.long)}
    shard = shard_batch(ids, cp, 0, cp_group=group.exchange(0), attention=layout.mode())["cp_shard"]
    row, first = sequence_rows(shard)
    block = query_block_tokens(cp * tokens)
    keys = 0
    for start in range(0, tokens, block):  # select_topk_keys' loop: each query block's span of key rows
        stop = min(start + block, tokens)
        keys += (stop - start) * (int(row[start:stop].max()) + 1 - int(first[start:stop].min()))
    tiles = math.ceil(tokens / shape.hidden) if layout.tiled else 0
    return Structure(tokens, math.ceil(tokens / block), keys, tiles)


def _op_features(s: Structure) -> dict[str, list[float]]:
    return {
        "indexer": [1, s.indexer_blocks],
        "attention": [1],
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

    for name in ("flops", "flops_in", "fp32_in", "sent"):
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
