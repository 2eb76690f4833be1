"""The FLOPs of one training step of one CP rank, as the plan counts them from a :class:`ModelShape`: the
model's own and what the layout's recomputation adds (what ``benchmarks/efficiency.py`` holds the executed
FLOPs to, counted on fake tensors).

The model's: ``6 N T`` for the ``T`` tokens of the rank, ``N`` the parameters a token uses (the decoder's,
a mixture of experts' routed experts at ``top_k / experts`` of theirs, and the LM head's; not the embedding,
a lookup), plus causal attention's ``6 (d_qk + d_v) h P`` per attention layer, ``P`` the query-key pairs the
rank's queries see: ``S (S + 1) / 2 / cp`` for a sequence of ``S`` tokens (every rank sees the same share),
and for a sparse attention layer ``min(i + 1, top_k)`` keys for the query at position ``i``; and a lightning
indexer's scores, ``2 H_i (D_i + 1) P`` per full indexer (forward only: it selects without a gradient), which
the layer's recomputation runs again whole. Not counted: a hybrid mixer's recurrence beyond its projections, the
norms and the softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_cp.plan.activations import local_tokens
from lightning_cp.plan.layout import Layout
from lightning_cp.plan.shape import ModelShape


@dataclass(frozen=True)
class StepFlops:
    """One CP rank's FLOPs for one step (forward and backward)."""

    model: int
    """The model's: ``6 N T``, causal attention and the indexers' scores (see the module docstring)."""
    recomputed: int
    """What recomputation adds: under checkpointing every decoder layer's forward once more (``2 N T``, a third
    of its attention, its indexer's scores); under ``+tiled`` the tiled MLPs' forward once more (``2 N_mlp T``)."""


def step_flops(shape: ModelShape, seq_len: int, layout: Layout) -> StepFlops:
    """:class:`StepFlops` of one sequence of ``seq_len`` tokens split over ``layout.cp`` ranks (one rank's
    ``T = local_tokens(seq_len, cp)`` tokens)."""
    tokens = local_tokens(seq_len, layout.cp)
    embeddings = (1 if shape.tied else 2) * shape.vocab * shape.hidden
    routed = shape.linears.expert_params if shape.linears is not None and shape.experts else 0
    decoder = shape.params - embeddings - routed * (shape.experts - shape.top_k) // max(shape.experts, 1)
    per_pair = 6 * (shape.head_dim + shape.v_head_dim) * shape.heads
    attention = per_pair * shape.dense_attention_layers * causal_pairs(seq_len, seq_len, layout.cp)
    indexer = 0
    if shape.sparse is not None:
        sparse = shape.sparse
        attention += per_pair * sparse.layers * causal_pairs(seq_len, sparse.topk, layout.cp)
        pairs = causal_pairs(seq_len, seq_len, layout.cp)
        indexer = 2 * sparse.heads * (sparse.head_dim + 1) * sparse.indexer_layers * pairs
    model = 6 * (decoder + shape.vocab * shape.hidden) * tokens + attention + indexer
    recomputed = 0
    if layout.checkpointing:
        recomputed += 2 * decoder * tokens + attention // 3 + indexer
    if layout.tiled:  # a gated MLP's three matrices, the GPT's two
        matrices = 3 if shape.architecture == "hf" else 2
        recomputed += 2 * matrices * shape.hidden * shape.mlp_width * shape.layers * tokens
    return StepFlops(model, recomputed)


def causal_pairs(seq_len: int, window: int, cp: int) -> int:
    """The query-key pairs one rank's queries see in a causal sequence of ``seq_len`` tokens split over ``cp``
    ranks, each query seeing at most ``window`` keys: ``sum_i min(i + 1, window) / cp``."""
    window = min(window, seq_len)
    return (window * (window + 1) // 2 + (seq_len - window) * window) // cp
