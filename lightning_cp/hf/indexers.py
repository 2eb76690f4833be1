"""DeepSeek Sparse Attention's lightning indexers, made exact under context parallelism, for stock ``transformers``.

The sparse-attention families (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, HY-V4, dots3) put a *lightning indexer* in each
sparse attention layer: it scores every earlier key of the sequence for each query and the attention reads only
the ``index_topk`` best. ``transformers`` runs the indexer inside the attention layer's forward on the tokens the
layer was given, with the dense mask, and hands the selected positions to the attention function as
``indices=`` (to every implementation but eager and SDPA, which fold them into a dense mask). Under CP a rank
holds two chunks of each sequence, so that indexer would pick from this rank's keys only.

:func:`adapt_indexers` gives every indexer of a family :data:`INDEXERS` knows a forward that, when its attention
layer was called with the batch's ``cp_shard``, computes the indexer's queries, per-head weights and keys with
the layer's own projections, norm and rotary embedding (:class:`DSAIndexer`, per family), and selects with
:func:`~lightning_cp.parallel.key_indexer.select_topk_keys` over every earlier key of the query's own sequence on
every rank (packed documents apart). The selection (rows in sequence order, ``[B, S_local, n]`` int32, ``-1``
for none) then reaches ``attn_implementation="lightning_cp"`` as ``indices=``, which attends to exactly those
keys (:func:`~lightning_cp.parallel.sparse_attention.sparse_attention`); layers that share the previous layer's
selection (GLM-MoE-DSA's and HY-V4's ``indexer_types="shared"``) pass it on unchanged. The attention refuses
``indices`` that no adapted indexer selected for the batch's shard.

The indexer's forward is shard-bound through its attention layer: a forward pre-hook on that layer hands the
indexer the call's ``cp_shard`` and a forward hook takes it back, so a checkpointed layer's recomputation selects
again alike. Without ``cp_shard`` (a callback, ``generate``, no strategy) the indexer is ``transformers``' own,
given the dense mask, and the attention applies its selection as the model's eager path does.

The indexers select under ``torch.no_grad`` in every family, and nothing trains them (no auxiliary loss in
``transformers``): their weights get no gradient here either, and :func:`adapt_indexers` says so by setting
their ``requires_grad`` to ``False``. DDP then leaves them out of its buckets; with ``requires_grad`` left on it
stops at the first step (a parameter that took no part in the loss), unless ``find_unused_parameters=True``
makes it search the graph at every step.

Families whose indexer is built otherwise are refused by name (:data:`REFUSED`).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_cp.constants import CP_SHARD
from lightning_cp.hf.attention import SELECTION_OF
from lightning_cp.hf.masks import DeferredMask
from lightning_cp.hf.mixers._adapter import kernels
from lightning_cp.parallel.key_indexer import select_topk_keys
from lightning_cp.parallel.shard import CPShard


@dataclass(frozen=True)
class DSAIndexer:
    """How one family's indexer computes its queries, weights and keys, in DeepSeek-V3.2's form: queries
    ``wq_b(q_resid)`` of ``n_heads`` x ``head_dim``, one key per token ``k_norm(wk(x))``, rotary embedding on
    ``qk_rope_head_dim`` of the dims, weights ``weights_proj(x) * n_heads ** -0.5``, scores
    ``sum_h w_h * relu(softmax_scale * q_h . k)``."""

    rotary: str
    """The modeling module's rotary function for the indexer: ``apply_rotary_pos_emb`` (half-split) or
    ``apply_rotary_pos_emb_interleave``."""
    rotary_last: bool = False
    """The rotary dims are the last ``qk_rope_head_dim`` (HY-V4), not the first."""
    norm_in_its_dtype: bool = False
    """The key norm runs in its weight's dtype and casts back (HY-V4's fp32 LayerNorm)."""
    scale_in_weights: bool = False
    """``softmax_scale`` multiplies the weights after the ReLU (HY-V4) instead of the scores inside it."""

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


_HALF_SPLIT = DSAIndexer("apply_rotary_pos_emb")
_INTERLEAVED = DSAIndexer("apply_rotary_pos_emb_interleave")

INDEXERS: dict[str, DSAIndexer] = {
    "DeepseekV32Indexer": _HALF_SPLIT,
    "AXK2Indexer": _HALF_SPLIT,
    "GlmMoeDsaIndexer": _INTERLEAVED,
    "Dots3NoteTextIndexer": _INTERLEAVED,
    "HYV4Indexer": DSAIndexer(
        "apply_rotary_pos_emb", rotary_last=True, norm_in_its_dtype=True, scale_in_weights=True
    ),
}
"""The indexer classes made context-parallel, by class name: how each computes its scores."""

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
name: why (the end of a sentence that starts with the module's name). Refused from the model's structure, before any weights are read."""

_SHARD = "_lightning_cp_indexer_shard"
_ADAPTED = "_lightning_cp_adapted_indexer"


def adapt_indexers(model: nn.Module) -> list[str]:
    """Give every indexer of ``model`` that :data:`INDEXERS` knows the context-parallel forward of this module's
    docstring, and its attention layer the hooks that hand it the call's ``cp_shard`` (once; the parameters and
    their names do not change). The indexers' parameters, which no loss reaches, are frozen.

    Returns:
        The names of the adapted indexers.
    """
    adapted = []
    for name, layer in model.named_modules():
        indexer = getattr(layer, "indexer", None)
        if not isinstance(indexer, nn.Module) or type(indexer).__name__ not in INDEXERS:
            continue
        if not getattr(indexer, _ADAPTED, False):
            indexer.forward = types.MethodType(_forward, indexer)
            layer.register_forward_pre_hook(_lend_shard(indexer), with_kwargs=True)
            layer.register_forward_hook(_take_shard_back(indexer), always_call=True)
            setattr(indexer, _ADAPTED, True)
        indexer.requires_grad_(False)
        adapted.append(f"{name}.indexer" if name else "indexer")
    return adapted


def _lend_shard(indexer: nn.Module) -> Callable[..., None]:
    def hook(_layer: nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        setattr(indexer, _SHARD, kwargs.get(CP_SHARD))

    return hook


def _take_shard_back(indexer: nn.Module) -> Callable[..., None]:
    def hook(_layer: nn.Module, _args: tuple, _output: Any) -> None:
        setattr(indexer, _SHARD, None)

    return hook


@functools.cache
def _signature(indexer_class: type) -> inspect.Signature:
    return inspect.signature(indexer_class.forward)


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
    """The adapted indexer's forward: the CP selection when its layer got the batch's shard, else
    ``transformers``' own on the dense mask."""
    bound = _signature(type(self)).bind(self, *args, **kwargs)
    arguments = bound.arguments
    shard: CPShard | None = getattr(self, _SHARD, None)
    if shard is None:
        mask = arguments.get("attention_mask")
        if isinstance(mask, DeferredMask):
            arguments["attention_mask"] = mask.build_additive()
        return type(self).forward(*bound.args, **bound.kwargs)
    if arguments.get("cache") is not None:
        raise ValueError(
            f"{type(self).__name__} was called with cp_shard and a cache: a cache of a shard cannot be continued. "
            "Call the model on a batch's shard with use_cache=False."
        )
    hidden_states = arguments["hidden_states"]
    with torch.no_grad():  # as the families select: the indexer gets no gradient
        queries, weights, keys, scale = INDEXERS[type(self).__name__].projections(
            self, hidden_states, arguments["q_resid"], arguments["position_embeddings"]
        )
        selected = select_topk_keys(
            queries.flatten(0, 1), weights.flatten(0, 1), keys.flatten(0, 1), shard, self.index_topk, scale
        )
    selected = selected.to(torch.int32).view(*hidden_states.shape[:2], -1)
    setattr(selected, SELECTION_OF, shard)
    return selected
