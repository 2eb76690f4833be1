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

Masks: ``transformers`` builds one mask per forward with the function registered for the implementation
in its ``AttentionMaskInterface``, which does not see the forward's keyword arguments. :func:`mask_for_hf`
therefore returns a :class:`DeferredMask` that only records what ``sdpa_mask`` would be called with. With
``cp_shard`` the attention never builds it (the shard defines causality and document boundaries; no
``[S_local, S_local]`` mask exists); without, the first layer builds it and every layer shares it.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch
from torch import Tensor, nn

from lightning_cp.constants import CP_SHARD
from lightning_cp.parallel.attention import context_parallel_attention
from lightning_cp.parallel.sharding import CPShard, sharded_under_cp

ATTN_IMPLEMENTATION = "lightning_cp"
"""The name to give ``transformers``: ``from_pretrained(..., attn_implementation="lightning_cp")``."""

SELECTION_OF = "_lightning_cp_selection_of"
"""The attribute an adapted sparse-attention indexer (:mod:`lightning_cp.hf.indexers`) sets on the keys it
selected: the :class:`~lightning_cp.parallel.CPShard` they are rows of. The attention takes ``indices`` only
with it."""

# Variants transformers' SDPA function cannot compute (it raises on softcap and ignores the sinks s_aux):
# without cp_shard they run the model's own eager attention, as transformers runs such models.
_NOT_IN_SDPA = ("softcap", "s_aux")

_WITHOUT_SHARD = (
    "The model was called on a batch sharded for context parallelism without its shard: each rank would "
    "attend only within its own tokens. Pass the batch's shard with its position_ids: "
    "model(input_ids=batch['input_ids'], position_ids=batch['position_ids'], cp_shard=batch['cp_shard'])."
)

# Attention variants the CP kernels do not compute, with what to set instead.
_UNSUPPORTED = {
    "position_bias": "additive position biases are not supported; use a rotary-embedding model",
}


class DeferredMask:
    """The SDPA mask of one forward, built on first use and then shared by every layer.

    Holds the keyword arguments ``transformers`` gave the mask hook (sizes, offsets, the mask pattern
    function, the user's 2-D ``attention_mask``); :meth:`build` returns ``sdpa_mask(**arguments)``
    (``[B, 1, S, S]`` bool, or ``None`` where SDPA's ``is_causal`` suffices), computed once. Also records
    what a context-parallel forward has verified (its ``position_ids`` tensor, a padding mask of ones), so
    each check runs once per forward.

    Only the registered attention function may read it. A model that uses the mask itself (adds it to
    its own scores, moves it, combines it with an ALiBi bias) computes attention outside ``transformers``'
    attention interface, which ``"lightning_cp"`` cannot reach: a tensor operation on the mask raises a
    ``ValueError`` that says so, and a tensor attribute an ``AttributeError`` with the same message. A slice
    (``mask[:, 0]``, what a sparse-attention layer hands its indexer) is a deferred mask of the slice, for the
    adapted indexer to build without ``cp_shard`` (:mod:`lightning_cp.hf.indexers`) and to ignore with it.
    """

    def __init__(self, arguments: dict[str, Any], index: Any = None) -> None:
        self.arguments = arguments
        self.index = index
        self.verified_positions: Tensor | None = None
        self.verified_no_padding = False
        self._masks: dict[str, Tensor | None] = {}

    @property
    def padding_mask(self) -> Tensor | None:
        """The 2-D ``[B, S]`` padding mask the model was called with (``attention_mask=``), if any."""
        return self.arguments.get("attention_mask")

    def build(self) -> Tensor | None:
        """``transformers.masking_utils.sdpa_mask`` of the recorded arguments (the first call computes it)."""
        if "sdpa" not in self._masks:
            from transformers.masking_utils import sdpa_mask

            self._masks["sdpa"] = self._indexed(sdpa_mask(**self.arguments))
        return self._masks["sdpa"]

    def build_additive(self) -> Tensor:
        """``transformers.masking_utils.eager_mask``: the same mask as 0 / -inf floats, for eager attention."""
        if "eager" not in self._masks:
            from transformers.masking_utils import eager_mask

            arguments = {k: v for k, v in self.arguments.items() if k != "allow_is_causal_skip"}
            self._masks["eager"] = self._indexed(eager_mask(**arguments))
        return self._masks["eager"]

    def _indexed(self, mask: Tensor | None) -> Tensor | None:
        return mask if mask is None or self.index is None else mask[self.index]

    def _misuse(self, use: str) -> str:
        model_type = getattr(self.arguments.get("config"), "model_type", "this model")
        if self.index is not None:  # a slice handed on, as sparse attention hands its indexer mask[:, 0]
            use = (
                f"{use} of a slice of it; a sparse-attention model reads it in its indexer until "
                "lightning_cp.hf.check_models or the strategy's setup adapts the indexers"
            )
        return (
            f'attn_implementation="{ATTN_IMPLEMENTATION}": {model_type} uses the attention mask itself ({use}) '
            "instead of handing it to the registered attention function, so its attention runs outside "
            "transformers' attention interface and cannot be made context-parallel. Build this model with "
            'attn_implementation="sdpa" (or "eager") and train it with cp=1.'
        )

    def __getattr__(self, name: str) -> Any:
        # An AttributeError still, so that getattr(mask, name, default) keeps its meaning.
        raise AttributeError(name if name.startswith("__") else self._misuse(f".{name}"))

    def __getitem__(self, index: Any) -> DeferredMask:
        """The mask of ``mask[index]``, deferred alike (a sparse-attention layer hands its indexer
        ``mask[:, 0, :, :]``); any use of it as a tensor still raises."""
        if self.index is not None:
            raise ValueError(self._misuse("indexing twice"))
        return DeferredMask(self.arguments, index)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Not a TypeError: torch turns that into NotImplemented for an operator, and Python into a bare
        # "unsupported operand type(s)".
        mask = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, DeferredMask))
        raise ValueError(mask._misuse(getattr(func, "__name__", str(func))))


def mask_for_hf(**arguments: Any) -> DeferredMask | Tensor | None:
    """The ``AttentionMaskInterface`` entry: a :class:`DeferredMask` of ``sdpa_mask``'s arguments.

    Only a mask whose queries and keys coincide (equal lengths, offsets 0: every context-parallel step,
    and a forward with an empty dynamic cache) is deferred. With a filled or static cache the mask is built
    at once: ``generate`` with a static cache builds masks ahead of the forward and handles them as tensors.
    """
    q_offset = arguments.get("q_offset", 0)
    queries_are_keys = (
        not isinstance(q_offset, Tensor)
        and q_offset == 0
        and arguments.get("kv_offset", 0) == 0
        and arguments["kv_length"] == arguments["q_length"]
    )
    mask = DeferredMask(arguments)
    return mask if queries_are_keys else mask.build()


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
        key: ``[B, Hkv, S_local, D]`` with ``Hkv`` dividing ``Hq``; never repeated to ``Hq`` heads.
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

    Communication: with ``cp_shard``, that of ``context_parallel_attention`` over the shard's CP group
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
    if cp_shard is None:
        return _sdpa(
            module, query, key, value, _with_selection(attention_mask, indices), scaling, dropout, kwargs
        )
    _check_supported(module, query, key, dropout, kwargs)
    _check_mask(attention_mask, cp_shard)
    _check_tokens(cp_shard, query)
    _check_positions(cp_shard, kwargs.get("position_ids"), attention_mask)
    out = context_parallel_attention(
        query,
        key,
        value,
        cp_shard=cp_shard,
        scale=scaling,
        window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
        selected=None if indices is None else _selected(module, indices, cp_shard),
    )
    return out.transpose(1, 2).contiguous(), None


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


def guard_sharded_calls(module: nn.Module) -> None:
    """Put a forward pre-hook on every ``transformers`` model in ``module`` (a causal LM and its decoder body
    alike), once, that checks each call against the batch's shard:

    * a call whose ``input_ids`` are a batch's shard
      (:func:`~lightning_cp.parallel.sharding.sharded_under_cp`) without the batch's ``cp_shard`` is refused:
      it passes neither the shard nor its ``position_ids`` to the attention, which would then attend within
      the rank's own tokens;
    * a call with ``cp_shard`` and an ``attention_mask`` that masks a token of the batch is refused, on every
      rank of the CP group alike (:meth:`~lightning_cp.parallel.CPShard.masks_tokens`: with right padding
      only one rank's slice holds the zeros), before any layer reaches the other ranks;
    * a call with ``cp_shard`` and no ``use_cache`` runs with ``use_cache=False``: a KV cache of a shard
      cannot be continued, and ``transformers`` would otherwise build one (its config's default) that keeps
      every layer's K/V of the shard alive until the step's outputs are freed (what ``transformers`` does
      itself under its own gradient checkpointing). An explicit ``use_cache`` is left as given.

    Other calls (another batch, ``generate``, no CP) are not affected. No communication.

    Raises (from the hook, at the call):
        ValueError: saying what to pass.
    """
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:  # transformers never loaded: no model of it can exist
        return
    for model in module.modules():
        if isinstance(model, modeling.PreTrainedModel) and not getattr(model, _GUARDED, False):
            model.register_forward_pre_hook(_guard_sharded_call, with_kwargs=True)
            setattr(model, _GUARDED, True)


_GUARDED = "_lightning_cp_guards_sharded_calls"


def _guard_sharded_call(
    module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    cp_shard = kwargs.get(CP_SHARD)
    if cp_shard is None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if sharded_under_cp(input_ids):
            raise ValueError(f"{type(module).__name__}: {_WITHOUT_SHARD}")
        return None
    mask = _argument(type(module), "attention_mask", args, kwargs)
    if isinstance(mask, Tensor) and (mask.dim() != 2 or cp_shard.masks_tokens(mask)):
        raise ValueError(f"{type(module).__name__}: {_MASK_WITH_SHARD}")
    # use_cache neither given by keyword nor positionally
    position = _argument_position(type(module), "use_cache")
    if kwargs.get("use_cache") is None and position is not None and position >= len(args):
        return args, {**kwargs, "use_cache": False}
    return None


def _argument(model_class: type, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The argument ``name`` of a call of ``model_class.forward``, by keyword or by position (else ``None``)."""
    if name in kwargs:
        return kwargs[name]
    position = _argument_position(model_class, name)
    return args[position] if position is not None and position < len(args) else None


@functools.cache
def _argument_position(model_class: type, name: str) -> int | None:
    """The position of ``name`` among the arguments of ``model_class.forward`` (after ``self``), or ``None``
    when it takes none: read once per class, not at every call."""
    parameters = list(inspect.signature(model_class.forward).parameters)[1:]
    return parameters.index(name) if name in parameters else None


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
            f"{_WITHOUT_SHARD} (If you did, {type(module).__name__} does not hand the decoder's keyword "
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


_MASK_WITH_SHARD = (
    'attn_implementation="lightning_cp" got an attention mask with cp_shard; the shard already defines '
    "causality and document boundaries. Do not pass attention_mask to the model (pad on the right and mark "
    "targets with loss_mask, or pack documents with cu_seqlens instead)."
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
    raise ValueError(_MASK_WITH_SHARD)


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
