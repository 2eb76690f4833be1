"""The attention function and mask hook behind ``attn_implementation="lightning_cp"``.

A Hugging Face attention layer computes its queries, keys and values (rotary embeddings applied from
the ``position_ids`` it was given) and hands them, with the keyword arguments of the decoder call, to the
function registered under its config's ``_attn_implementation``. The batch's
:class:`~lightning_cp.parallel.CPShard` reaches it that way, as ``position_ids`` does::

    out = decoder(model)(  # lightning_cp.hf.decoder: the model's get_decoder()
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], cp_shard=batch["cp_shard"]
    )

Given ``cp_shard``, :func:`hf_context_parallel_attention` calls
:func:`~lightning_cp.parallel.context_parallel_attention` with it, over the CP group the shard carries and
by the exchange its attention mode names (the strategies' ``cp_attention``: the key/value heads
all-gathered, or Ulysses' all-to-all), with the layer's variants: its ``scaling``, its ``sliding_window`` (per layer), its logit ``softcap`` (Gemma-2),
its attention sinks (``s_aux``, gpt-oss) and a value head dim of its own (DeepSeek's MLA). Without it,
the function is exactly ``transformers``' ``"sdpa"`` attention, so the same model runs anywhere: in a
callback, as a teacher on other tensors, without a strategy, in ``generate``.

Masks: the mask hook gives a :class:`~lightning_cp.hf.masks.DeferredMask` (:mod:`lightning_cp.hf.masks`),
which the attention never builds with ``cp_shard`` and builds once per forward without. The model's own call
is checked against the shard before any layer runs (:mod:`lightning_cp.hf.sharded_calls`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from lightning_cp.constants import CP_SHARD
from lightning_cp.hf.latent import attend, attend_selected, expand, latent_layer
from lightning_cp.hf.masks import DeferredMask
from lightning_cp.hf.sharded_calls import MASK_WITH_SHARD, WITHOUT_SHARD
from lightning_cp.parallel.attention import context_parallel_attention
from lightning_cp.parallel.shard import CPShard
from lightning_cp.parallel.sharding import sharded_under_cp

SELECTION_OF = "_lightning_cp_selection_of"
"""The attribute an adapted sparse-attention indexer (:mod:`lightning_cp.hf.indexers`) sets on the keys it
selected: the :class:`~lightning_cp.parallel.CPShard` they are rows of. The attention takes ``indices`` only
with it."""

# Variants transformers' SDPA function cannot compute (it raises on softcap and ignores the sinks s_aux):
# without cp_shard they run the model's own eager attention, as transformers runs such models.
_NOT_IN_SDPA = ("softcap", "s_aux")


# Attention variants the CP kernels do not compute, with what to set instead.
_UNSUPPORTED = {
    "position_bias": "additive position biases are not supported; use a rotary-embedding model",
    "block_indices": (
        "block-sparse key selection (MiniMax-M3's sparse layers) is not computed; use a config whose layer_types "
        "has no sparse layers, or train with attn_implementation='sdpa' and cp=1"
    ),
}


def hf_context_parallel_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: DeferredMask | Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention of a ``transformers`` layer: over whole sequences given ``cp_shard``, else ``"sdpa"``.

    Args:
        module: the calling attention layer (read for ``is_causal``).
        query: ``[B, Hq, S_local, D]``, this rank's queries (rotary embeddings applied).
        key: ``[B, Hkv, S_local, D]`` with ``Hkv`` dividing ``Hq``; never repeated to ``Hq`` heads. Or an MLA
            layer's unexpanded latent ``[B, 1, S_local, R]`` (:mod:`lightning_cp.hf.latent`), ``value`` then its
            rotary key part ``[B, 1, S_local, Dr]``: attended to from the latent with ``cp_shard``, else
            expanded by the layer's own ``expand_kv`` first.
        value: ``[B, Hkv, S_local, Dv]`` (``Dv != D`` for multi-head latent attention).
        attention_mask: what :func:`mask_for_hf` returned (or a 4-D mask the model was called with).
        scaling: softmax scale (default ``D ** -0.5``).
        dropout: attention dropout probability; must be 0 with ``cp_shard``.
        **kwargs: the decoder call's keywords and the layer's variants. ``cp_shard``: the batch's
            :class:`~lightning_cp.parallel.CPShard` (``batch["cp_shard"]``); with it ``position_ids`` must
            be the batch's (checked once per forward), and the layer's ``sliding_window`` (tokens),
            ``softcap`` (attention logit softcapping) and ``s_aux`` (``[Hq]`` attention sinks) become
            :func:`~lightning_cp.parallel.context_parallel_attention`'s ``window``, ``softcap`` and ``sinks``;
            ``position_bias`` must be ``None``. ``indices`` (``[B, S_local, n]``, sparse attention's selected
            keys, which ``transformers`` hands every implementation but eager and SDPA): with ``cp_shard`` the
            selection of an adapted indexer (:mod:`lightning_cp.hf.indexers`), attended to exactly
            (``context_parallel_attention(selected=...)``); without, folded into the dense mask as the model's
            eager path does.

    Returns:
        ``([B, S_local, Hq, Dv], None)``: the output (with ``cp_shard`` in the compute dtype of
        :func:`~lightning_cp.parallel.attention.compute_dtype`, else SDPA's), and no attention weights.

    Communication: with ``cp_shard``, an MLA latent's: one all-gather of ``[T_local, R + Dr]`` forward, the same
    and one reduce-scatter backward (:func:`~lightning_cp.parallel.latent_attention.latent_attention`, or
    ``sparse_attention``'s of that one key in the absorbed form); else that of ``context_parallel_attention``
    over the shard's CP group
    (the all-gather: per round of key/value heads one all-gather of K and V forward, the same again and
    one reduce-scatter backward; Ulysses: one all-to-all each way, forward and backward; none without CP).
    Without ``cp_shard`` none: this is ``transformers``' SDPA attention.

    Raises:
        ValueError: without ``cp_shard``, ``position_ids`` of a batch sharded over ``cp > 1`` ranks (the
            model would attend within this rank's shard). With it: an unsupported variant (a position bias,
            dropout, non-causal attention), query heads not a multiple of key/value heads, an attention
            mask, tensors that are not the shard's, ``position_ids`` that are not the batch's, or ``indices``
            that no adapted indexer selected for the shard.
    """
    cp_shard = kwargs.pop(CP_SHARD, None)
    indices = kwargs.pop("indices", None)
    layer = latent_layer(key)
    if layer is not None and not _on_latent(cp_shard, indices, kwargs):
        key, value = expand(layer, key, value)  # as the family's own expand_kv would have handed them
        layer = None
    if cp_shard is None:
        mask = _with_selection(attention_mask, indices)
        mask = _with_blocks(module, mask, kwargs.pop("block_indices", None), query, key, kwargs)
        return _sdpa(module, query, key, value, mask, scaling, dropout, kwargs)
    _check_supported(module, query, key, dropout, kwargs)
    _check_mask(attention_mask, cp_shard)
    _check_tokens(cp_shard, query)
    _check_positions(cp_shard, kwargs.get("position_ids"), attention_mask)
    selected = None if indices is None else _selected(module, indices, cp_shard)
    if layer is not None:
        out = _latent_attention(layer, query, key, value, selected, cp_shard, scaling, kwargs)
        return out.transpose(1, 2).contiguous(), None
    out = context_parallel_attention(
        query,
        key,
        value,
        cp_shard=cp_shard,
        scale=scaling,
        window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
        selected=selected,
    )
    return out.transpose(1, 2).contiguous(), None


def _on_latent(cp_shard: CPShard | None, indices: Tensor | None, kwargs: dict[str, Any]) -> bool:
    """Whether an MLA layer's unexpanded latent is attended to as it is (:mod:`lightning_cp.hf.latent`): with
    ``cp_shard``, and for a sparse selection only without a window or softcap (which the selected keys'
    attention refuses by name, as for any other model)."""
    plain = all(kwargs.get(variant) is None for variant in ("sliding_window", "softcap"))
    return cp_shard is not None and (indices is None or plain)


def _latent_attention(
    layer: nn.Module,
    query: Tensor,
    latent: Tensor,
    k_rot: Tensor,
    selected: Tensor | None,
    cp_shard: CPShard,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> Tensor:
    """An MLA layer's attention from its latent ``[B, 1, S_local, R]`` and rotary part: over ``selected`` keys
    in the absorbed form, else expanded per round of heads after one all-gather of the latent."""
    if selected is not None:
        return attend_selected(layer, query, latent, k_rot, selected, cp_shard, scaling, kwargs.get("s_aux"))
    return attend(
        layer,
        query,
        latent,
        k_rot,
        cp_shard,
        scaling,
        window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )


def _selected(module: nn.Module, indices: Tensor, cp_shard: CPShard) -> Tensor:
    """``indices`` ``[B, S_local, n]`` as ``[B * S_local, n]`` selected rows, if an adapted indexer selected them
    for ``cp_shard`` (:data:`SELECTION_OF`)."""
    if getattr(indices, SELECTION_OF, None) is not cp_shard:
        raise ValueError(
            f"{type(module).__name__} passed sparse-attention indices that lightning_cp's context-parallel "
            "indexer did not select for this batch's shard: its indexer would have scored this rank's keys "
            "only. This model's sparse attention cannot be trained with lightning_cp's CP (see "
            "lightning_cp.hf.indexers for the families it supports)."
        )
    return indices.flatten(0, 1)


def _with_selection(attention_mask: DeferredMask | Tensor | None, indices: Tensor | None) -> Tensor | None:
    """Without ``cp_shard``: the model's dense mask ``[B, 1, S, T]`` with every key its indexer did not select
    for a query masked, as ``transformers``' eager and SDPA paths fold ``indices`` into the mask (a boolean mask
    stays boolean, an additive one gets the dtype's min)."""
    if indices is None:
        return attention_mask
    mask = attention_mask.build_additive() if isinstance(attention_mask, DeferredMask) else attention_mask
    if mask is None:
        raise ValueError(
            "sparse-attention indices without cp_shard need the model's attention mask (its indexer selects "
            "among masked keys too); build the model's mask with allow_is_causal_skip=False, as the sparse "
            "families do, or call it with cp_shard=batch['cp_shard']."
        )
    unselected = torch.ones(mask.shape[0], *mask.shape[2:], dtype=torch.bool, device=mask.device)
    unselected = unselected.scatter(-1, indices.long(), False).unsqueeze(1)
    if mask.dtype == torch.bool:
        return mask & ~unselected
    return mask.masked_fill(unselected, torch.finfo(mask.dtype).min)


def _with_blocks(
    module: nn.Module,
    attention_mask: DeferredMask | Tensor | None,
    blocks: Tensor | None,
    query: Tensor,
    key: Tensor,
    kwargs: dict[str, Any],
) -> DeferredMask | Tensor | None:
    """Without ``cp_shard``: the mask ``[B, Hq, S, T]`` of the key blocks a block-sparse indexer selected
    (MiniMax-M3's ``block_indices`` ``[B, H_index, S, n]``), built by the layer's own indexer as the model's eager
    and SDPA paths build it; ``attention_mask`` itself without blocks."""
    if blocks is None:
        return attention_mask
    if isinstance(attention_mask, DeferredMask):
        attention_mask = attention_mask.build()
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)
    positions = (positions if positions.ndim > 1 else positions.unsqueeze(0)).expand(query.shape[0], -1)
    return module.indexer.build_block_mask(
        blocks, attention_mask, key.shape[2], query.dtype, query.device, positions
    )


def _sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: DeferredMask | Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[Tensor, None]:
    if sharded_under_cp(kwargs.get("position_ids")):
        raise ValueError(
            f"{WITHOUT_SHARD} (If you did, {type(module).__name__} does not hand the decoder's keyword "
            "arguments on to its attention function, and cannot be trained under CP.)"
        )
    if any(kwargs.get(variant) is not None for variant in _NOT_IN_SDPA):
        return _eager(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    if isinstance(attention_mask, DeferredMask):
        attention_mask = attention_mask.build()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def _eager(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: DeferredMask | Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    """The model's own eager attention, for what SDPA cannot compute (logit softcapping, attention sinks):
    what ``transformers`` itself runs for such a model."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        variants = [v for v in _NOT_IN_SDPA if kwargs.get(v) is not None]
        raise ValueError(
            f"{type(module).__name__} passed {', '.join(variants)}, which SDPA cannot compute, and its module "
            "has no eager_attention_forward to fall back to without cp_shard; call the model with "
            "cp_shard=batch['cp_shard'], or build it with its default attention implementation."
        )
    if isinstance(attention_mask, DeferredMask):
        attention_mask = attention_mask.build_additive()
    elif attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.where(attention_mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _describe(value: Any) -> str:
    """A value for an error message: a tensor by its shape, not its values."""
    return f"<a tensor of shape {tuple(value.shape)}>" if isinstance(value, Tensor) else repr(value)


def _check_supported(
    module: nn.Module, query: Tensor, key: Tensor, dropout: float, kwargs: dict[str, Any]
) -> None:
    name = type(module).__name__
    for variant, instead in _UNSUPPORTED.items():
        if kwargs.get(variant) is not None:
            raise ValueError(
                f'attn_implementation="lightning_cp" computes plain causal attention, but {name} passed '
                f"{variant}={_describe(kwargs[variant])}: {instead}."
            )
    if dropout:
        raise ValueError(
            f'attn_implementation="lightning_cp" has no attention dropout, but {name} passed '
            f"dropout={dropout}: set the config's attention_dropout=0.0."
        )
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError(
            f'attn_implementation="lightning_cp" is causal attention, but {name} is bidirectional '
            "(is_causal=False): use it only in causal decoder layers."
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"{name} has {query.shape[1]} query heads and {key.shape[1]} key/value heads: the config's "
            "num_attention_heads must be a multiple of num_key_value_heads."
        )


def _check_mask(attention_mask: DeferredMask | Tensor | None, cp_shard: CPShard) -> None:
    """Refuse a mask that masks a token (a 2-D padding mask: of the whole batch, so that every rank of the
    CP group refuses it alike), or any other mask."""
    deferred = attention_mask if isinstance(attention_mask, DeferredMask) else None
    user_mask = attention_mask if deferred is None else deferred.padding_mask
    if user_mask is None or (deferred is not None and deferred.verified_no_padding):
        return
    # Some models make an all-ones padding mask themselves: it masks nothing (checked once per forward).
    if deferred is not None and user_mask.dim() == 2 and not cp_shard.masks_tokens(user_mask):
        deferred.verified_no_padding = True
        return
    raise ValueError(MASK_WITH_SHARD)


def _check_tokens(cp_shard: CPShard, query: Tensor) -> None:
    rows, _, length, _ = query.shape
    if rows * length != cp_shard.local_tokens:
        raise ValueError(
            f'attn_implementation="lightning_cp" got queries of {rows} x {length} tokens, but cp_shard holds '
            f"{cp_shard.local_tokens} tokens on this rank: call the model on the batch the shard belongs to "
            "(batch['input_ids'], already this rank's shard) with that batch's cp_shard."
        )


def _check_positions(
    cp_shard: CPShard, position_ids: Tensor | None, attention_mask: DeferredMask | Tensor | None
) -> None:
    expected = cp_shard.position_ids
    # Models without position_ids in their attention keywords, and shards built without a batch, cannot
    # be checked here.
    if expected is None or position_ids is None or position_ids is expected:
        return
    forward = attention_mask if isinstance(attention_mask, DeferredMask) else None
    if forward is not None and forward.verified_positions is position_ids:
        return
    same = position_ids.shape[-1] == expected.shape[-1] and torch.equal(
        position_ids.expand_as(expected), expected
    )
    if not same:
        raise ValueError(
            "The model was not given the batch's position_ids: under context parallelism each rank holds two "
            "separate chunks of every sequence (and packed documents restart at 0), so positions counted "
            "from 0 over the local tokens are wrong. Call the model with position_ids=batch['position_ids']."
        )
    if forward is not None:
        forward.verified_positions = position_ids
