"""DeepSeek Sparse Attention's lightning indexers, made exact under context parallelism, for stock ``transformers``.

The sparse-attention families (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, HY-V4, dots3) put a *lightning indexer* in each
sparse attention layer: it scores every earlier key of the sequence for each query and the attention reads only
the ``index_topk`` best. ``transformers`` runs the indexer inside the attention layer's forward on the tokens the
layer was given, with the dense mask, and hands the selected positions to the attention function as
``indices=`` (to every implementation but eager and SDPA, which fold them into a dense mask). Under CP a rank
holds two chunks of each sequence, so that indexer would pick from this rank's keys only.

:func:`adapt_indexers` gives every indexer of a family :data:`~lightning_cp.hf.sparse_kinds.INDEXERS` describes
a forward that, when its attention layer was called with the batch's ``cp_shard``, computes the indexer's queries,
per-head weights and keys with the layer's own projections, norm and rotary embedding as its family's description
says (:meth:`IndexerKind.projections <lightning_cp.hf.sparse_kinds.IndexerKind.projections>`), and selects with
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

A family is described once, in :mod:`lightning_cp.hf.sparse_kinds` (also read by the setup checks and the memory
plan); families whose indexer is built otherwise are refused by name there (its ``REFUSED``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_cp.adaptation import add_hooks, replace_forward
from lightning_cp.constants import CP_SHARD
from lightning_cp.hf.attention import SELECTION_OF
from lightning_cp.hf.masks import DeferredMask
from lightning_cp.hf.sparse_kinds import INDEXERS, indexer_kind
from lightning_cp.parallel.key_indexer import select_topk_keys
from lightning_cp.parallel.shard import CPShard

SELECTION_DTYPE = torch.int32
"""The dtype of the selection handed to the attention (which keeps it for its backward: half of int64's bytes)."""

_SHARD = "_lightning_cp_indexer_shard"


def adapt_indexers(model: nn.Module) -> list[str]:
    """Give every indexer of ``model`` that :data:`~lightning_cp.hf.sparse_kinds.INDEXERS` describes the
    context-parallel forward of this module's docstring, and its attention layer the hooks that hand it the call's
    ``cp_shard`` (once; the parameters and their names do not change). The indexers' parameters, which no loss
    reaches, are frozen.

    Returns:
        The names of the adapted indexers.
    """
    adapted = []
    for name, layer in model.named_modules():
        indexer = getattr(layer, "indexer", None)
        if not isinstance(indexer, nn.Module) or indexer_kind(indexer) is None:
            continue
        if replace_forward(indexer, "indexer", _forward):
            add_hooks(layer, "indexer", _lend_shard(indexer), _take_shard_back(indexer), with_kwargs=True)
        indexer.requires_grad_(False)
        adapted.append(f"{name}.indexer" if name else "indexer")
    return adapted


def _lend_shard(indexer: nn.Module) -> Callable[..., None]:
    def hook(_layer: nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        setattr(indexer, _SHARD, kwargs.get(CP_SHARD))

    return hook


def _take_shard_back(indexer: nn.Module) -> Callable[..., None]:
    def hook(_layer: nn.Module, _args: tuple, _kwargs: dict[str, Any], _output: Any) -> None:
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
    selected = selected.to(SELECTION_DTYPE).view(*hidden_states.shape[:2], -1)
    setattr(selected, SELECTION_OF, shard)
    return selected
