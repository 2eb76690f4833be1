"""What each sparse-attention family is, written once: its lightning indexer, how that indexer scores, where the
config gives its sizes and which layers select; and the indexers no adapter computes, with why.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, HY-V4, dots3) puts a *lightning indexer* in each
sparse attention layer. An :class:`IndexerKind` is one family's description, found by its indexer's class name
(:data:`INDEXERS`, :func:`indexer_kind`). Three readers use it:

- the adapter (:mod:`lightning_cp.hf.indexers`) computes the indexer's queries, weights and keys with it
  (:meth:`IndexerKind.projections`) and selects over every rank's keys
  (:func:`~lightning_cp.parallel.key_indexer.select_topk_keys`);
- the setup checks (:func:`~lightning_cp.hf.check.check_token_mixers`, also on a ``meta`` build before launch)
  refuse the indexers of :data:`REFUSED` by name under CP;
- the memory plan reads a model's sizes with it (:meth:`IndexerKind.sizes`, a :class:`SparseIndexer`:
  :attr:`lightning_cp.plan.ModelShape.sparse`), its per-rank bytes from the kernels' own block sizes
  (:mod:`lightning_cp.plan.sparse`).

A family whose indexer scores as DeepSeek-V3.2's (the ReLU of each head's query-key products, weighted and summed
over the heads, one key per token) is one entry of :data:`INDEXERS`; one that selects otherwise is one entry of
:data:`REFUSED` until a kernel computes its selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_cp.hf.mixers._adapter import kernels

HALF_SPLIT = "apply_rotary_pos_emb"
"""The modeling modules' rotary function that rotates the two halves of the rotary dims."""
INTERLEAVED = "apply_rotary_pos_emb_interleave"
"""The modeling modules' rotary function that rotates interleaved pairs of the rotary dims."""


@dataclass(frozen=True)
class SparseIndexer:
    """DeepSeek Sparse Attention's sizes in a model: each query attends to the ``topk`` keys a lightning indexer of
    ``heads`` heads of ``head_dim`` dims (one key of ``head_dim`` per token) selects
    (:mod:`lightning_cp.parallel.key_indexer`, :mod:`lightning_cp.parallel.sparse_attention`)."""

    topk: int
    """Keys each query attends to (``index_topk``)."""
    heads: int
    """Indexer query heads (``index_n_heads``)."""
    head_dim: int
    """Dims of an indexer head and of its one key per token (``index_head_dim``)."""
    layers: int
    """Layers whose attention is sparse."""
    indexer_layers: int
    """Of those, the layers with a full indexer (``indexer_types`` ``"full"``); the others (``"shared"``)
    reuse the previous full layer's selection."""


@dataclass(frozen=True)
class IndexerKind:
    """One family's lightning indexer, in DeepSeek-V3.2's form: queries ``wq_b(q_resid)`` of ``n_heads`` x
    ``head_dim``, one key per token ``k_norm(wk(x))``, rotary embedding on ``qk_rope_head_dim`` of the dims,
    weights ``weights_proj(x) * n_heads ** -0.5``, scores ``sum_h w_h * relu(softmax_scale * q_h . k)``; and
    the config keys that size it."""

    indexer: str
    """The indexer's class name in the family's modeling module: how the adapter, the checks and the plan find
    it in a model."""
    rotary: str
    """The modeling module's rotary function for the indexer: :data:`HALF_SPLIT` or :data:`INTERLEAVED`."""
    rotary_last: bool = False
    """The rotary dims are the last ``qk_rope_head_dim`` (HY-V4), not the first."""
    norm_in_its_dtype: bool = False
    """The key norm runs in its weight's dtype and casts back (HY-V4's fp32 LayerNorm)."""
    scale_in_weights: bool = False
    """``softmax_scale`` multiplies the weights after the ReLU (HY-V4) instead of the scores inside it."""
    topk_key: str = "index_topk"
    """The config key of the keys each query attends to."""
    heads_key: str = "index_n_heads"
    """The config key of the indexer's query heads."""
    head_dim_key: str = "index_head_dim"
    """The config key of the dims of an indexer head (and of its one key per token)."""
    layer_type: str = "indexed_attention"
    """The ``layer_types`` entry of a sparse attention layer; a config without ``layer_types`` has only sparse
    layers."""
    selection_key: str = "indexer_types"
    """The config list that says, per sparse layer, whether its indexer selects (``"full"``) or the layer
    reuses the previous full layer's selection (``"shared"``, without an indexer); without it every sparse
    layer selects."""

    def sizes(self, config: Any) -> SparseIndexer:
        """The sizes of a model of this family, read from its (text) ``config`` (a ``transformers`` config: its
        defaults filled). Reads the config only."""
        layer_types = getattr(config, "layer_types", None) or [self.layer_type] * config.num_hidden_layers
        layers = sum(kind == self.layer_type for kind in layer_types)
        selections = getattr(config, self.selection_key, None) or ["full"] * layers
        return SparseIndexer(
            topk=getattr(config, self.topk_key),
            heads=getattr(config, self.heads_key),
            head_dim=getattr(config, self.head_dim_key),
            layers=layers,
            indexer_layers=sum(kind == "full" for kind in selections),
        )

    def projections(
        self,
        indexer: nn.Module,
        hidden_states: Tensor,
        q_resid: Tensor,
        position_embeddings: tuple[Tensor, Tensor],
    ) -> tuple[Tensor, Tensor, Tensor, float]:
        """``(queries [B, S, H, D], weights [B, S, H] fp32, keys [B, S, D], scale)`` of ``indexer`` on this rank's
        tokens, computed as the family's forward computes them (the rotary tables are the batch's positions')."""
        batch, length, _ = hidden_states.shape
        cos, sin = position_embeddings
        queries = indexer.wq_b(q_resid).view(batch, length, indexer.n_heads, indexer.head_dim)
        keys = indexer.wk(hidden_states)
        if self.norm_in_its_dtype:
            keys = indexer.k_norm(keys.to(indexer.k_norm.weight.dtype)).to(hidden_states.dtype)
        else:
            keys = indexer.k_norm(keys)
        keys = keys.unsqueeze(2)
        rope = indexer.qk_rope_head_dim
        sizes = [indexer.head_dim - rope, rope] if self.rotary_last else [rope, indexer.head_dim - rope]
        at = 1 if self.rotary_last else 0
        query_parts, key_parts = list(queries.split(sizes, dim=-1)), list(keys.split(sizes, dim=-1))
        rotate = getattr(kernels(indexer), self.rotary)
        query_parts[at], key_parts[at] = rotate(query_parts[at], key_parts[at], cos, sin, unsqueeze_dim=2)
        queries, keys = torch.cat(query_parts, dim=-1), torch.cat(key_parts, dim=-1).squeeze(2)
        weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        weights = weights * indexer.n_heads**-0.5
        scale = indexer.softmax_scale
        if self.scale_in_weights:
            weights, scale = weights * scale, 1.0
        return queries, weights, keys, scale


INDEXERS: dict[str, IndexerKind] = {
    kind.indexer: kind
    for kind in (
        IndexerKind("DeepseekV32Indexer", HALF_SPLIT),  # deepseek_v32
        IndexerKind("AXK2Indexer", HALF_SPLIT),  # axk2
        IndexerKind("GlmMoeDsaIndexer", INTERLEAVED),  # glm_moe_dsa (GLM-5)
        IndexerKind("Dots3NoteTextIndexer", INTERLEAVED),  # dots3_note_text, dots3_note's text model
        IndexerKind(  # hy_v4
            "HYV4Indexer", HALF_SPLIT, rotary_last=True, norm_in_its_dtype=True, scale_in_weights=True
        ),
    )
}
"""The indexers made context-parallel, one description per family, by class name."""

REFUSED: dict[str, str] = {
    "Qwen4ExpTextQSAIndexer": (
        "is a sparse-attention indexer that lightning_cp's CP indexer does not compute: Qwen4's block-sparse "
        "selection scores mean-pooled blocks of keys and returns a dense [S, T] mask the attention reads itself"
    ),
    "Glm5NextTextIndexer": (
        "is a sparse-attention indexer that lightning_cp's CP indexer does not compute: GLM-5-Next scores gated "
        "pools of keys, takes causality from its own positions and rebuilds a dense mask from its selection"
    ),
    "MistralLarge4TextIndexer": (
        "is a sparse-attention indexer that lightning_cp's CP indexer does not compute: Mistral-Large-4's queries "
        "come from a normed residual with a learned per-position log scale, and some layers have no rotary part"
    ),
    "MiniMaxM3VLIndexer": (
        "is a sparse-attention indexer that lightning_cp's CP indexer does not compute: MiniMax-M3 selects blocks "
        "of keys per key/value head, anchored to absolute key slots, and hands them to the attention as "
        "block_indices"
    ),
    "DeepseekV4Indexer": (
        "is a sparse-attention indexer that lightning_cp's CP indexer does not compute: DeepSeek-V4 selects among "
        "compressed keys (overlapping pooled windows), whose compression crosses the CP shards"
    ),
    "DeepseekV4HCACompressor": (
        "is DeepSeek-V4's heavily compressed attention, which lightning_cp's CP does not compute: it pools windows "
        "of keys that cross the CP shards and hands them to the attention through a bias in the mask"
    ),
}
"""Sparse-attention indexers (and DeepSeek-V4's compressor of its own) no adapter makes exact under CP, by class
name: why (the end of a sentence that starts with the module's name). Refused from the model's structure, before
any weights are read."""


def indexer_kind(module: nn.Module) -> IndexerKind | None:
    """``module``'s family description if it is an indexer :data:`INDEXERS` knows, else ``None``. Reads the class
    name only: a ``meta`` build will do."""
    return INDEXERS.get(type(module).__name__)
