"""The attention function and mask hook behind ``attn_implementation="lightning_cp"``.

A Hugging Face attention layer computes its queries, keys and values (rotary embeddings applied from
the ``position_ids`` it was given) and hands them to the function registered under its config's
``_attn_implementation``. Under :class:`~lightning_cp.MegatronCPStrategy` those are this rank's tokens
only, so :func:`hf_context_parallel_attention` calls
:func:`~lightning_cp.parallel.context_parallel_attention` with the batch's
:class:`~lightning_cp.parallel.CPShard` (from :func:`~lightning_cp.parallel.batch_context.current_batch`,
recorded by the strategy) and the CP group of :func:`~lightning_cp.parallel.current_layout`. With
grouped- or multi-query attention only the key/value heads are all-gathered.

Masks: ``transformers`` builds one mask per forward with the function registered for the implementation
in its ``AttentionMaskInterface``. A mask over the local shard would be wrong under CP (causality runs
over the whole sequence, and packed documents are cut into pieces on every rank), so during a sharded
step :func:`mask_for_hf` builds none: causality and document boundaries come from the shard layout.
Outside a sharded step (no strategy, no recorded batch) both functions are exactly ``transformers``'
``"sdpa"`` ones, so the same model runs anywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_cp.parallel.attention import context_parallel_attention
from lightning_cp.parallel.batch_context import CurrentBatch, current_batch
from lightning_cp.parallel.layout import current_layout

ATTN_IMPLEMENTATION = "lightning_cp"
"""The name to give ``transformers``: ``from_pretrained(..., attn_implementation="lightning_cp")``."""

# Attention variants the CP kernels do not compute, with what to set instead.
_UNSUPPORTED = {
    "sliding_window": "use full attention in every layer: set the config's sliding_window=None "
    "(and use_sliding_window=False where the model has it)",
    "softcap": "set the config's attn_logit_softcapping=None",
    "s_aux": "attention sinks are not supported; use a model without them",
    "position_bias": "additive position biases are not supported; use a rotary-embedding model",
}


def hf_context_parallel_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention of a ``transformers`` layer over whole sequences, each rank holding its shard.

    Args:
        module: the calling attention layer (read for ``is_causal``).
        query: ``[B, Hq, S_local, D]``, this rank's queries (rotary embeddings applied).
        key, value: ``[B, Hkv, S_local, D]`` with ``Hkv`` dividing ``Hq``; never repeated to ``Hq`` heads.
        attention_mask: what :func:`mask_for_hf` built: ``None`` during a sharded step.
        scaling: softmax scale (default ``D ** -0.5``).
        dropout: attention dropout probability; must be 0.
        **kwargs: the layer's other keywords; ``position_ids`` is checked against the batch's once per
            batch, and ``sliding_window``, ``softcap``, ``s_aux``, ``position_bias`` must be ``None``.

    Returns:
        ``([B, S_local, Hq, D], None)``: the output in ``query``'s dtype, and no attention weights.

    Communication: during a sharded step, that of ``context_parallel_attention`` over the current
    layout's CP group (one all-gather of K and V forward; the same again and one reduce-scatter
    backward); none without CP. Outside a sharded step this is ``transformers``' SDPA attention.

    Raises:
        ValueError: an unsupported variant (sliding window, softcap, sinks, bias, dropout, non-causal),
            query heads not a multiple of key/value heads,
            a mask given during a sharded step, tensors that are not the current batch's shard, or a
            model called without the batch's ``position_ids``.
    """
    _check_supported(module, dropout, kwargs)
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"{type(module).__name__} has {query.shape[1]} query heads and {key.shape[1]} key/value heads: "
            "the config's num_attention_heads must be a multiple of num_key_value_heads."
        )
    batch = current_batch()
    if batch is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if attention_mask is not None:
        raise ValueError(
            'attn_implementation="lightning_cp" got an attention mask during a context-parallel step; the '
            "batch's shard layout already defines causality and document boundaries. Do not pass a 4-D "
            "attention_mask to the model (pad on the right and mark targets with loss_mask instead)."
        )
    _check_batch(batch, query, kwargs.get("position_ids"))
    out = context_parallel_attention(
        query,
        key,
        value,
        cp_shard=batch.cp_shard,
        cp_group=current_layout().cp_group,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


def mask_for_hf(*, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """The ``AttentionMaskInterface`` entry: no mask during a sharded step, else ``transformers``' SDPA mask."""
    if current_batch() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def _check_supported(module: nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    for name, instead in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f'attn_implementation="lightning_cp" computes plain causal attention, but '
                f"{type(module).__name__} passed {name}={kwargs[name]!r}: {instead}."
            )
    if dropout:
        raise ValueError(
            f'attn_implementation="lightning_cp" has no attention dropout, but {type(module).__name__} '
            f"passed dropout={dropout}: set the config's attention_dropout=0.0."
        )
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError(
            f'attn_implementation="lightning_cp" is causal attention, but {type(module).__name__} is '
            "bidirectional (is_causal=False): use it only in causal decoder layers."
        )


def _check_batch(batch: CurrentBatch, query: Tensor, position_ids: Tensor | None) -> None:
    rows, _, length, _ = query.shape
    shard = batch.cp_shard
    if rows * length != shard.local_tokens:
        raise ValueError(
            f'attn_implementation="lightning_cp" got queries of {rows} x {length} tokens, but the current '
            f"batch holds {shard.local_tokens} tokens on this rank: call the model on the batch the strategy "
            "passed to the step (batch['input_ids'], already this rank's shard), not on other tensors."
        )
    if batch.positions_checked:
        return
    # Models without position_ids in their attention keywords cannot be checked here.
    if position_ids is not None and position_ids is not batch.position_ids:
        expected = batch.position_ids
        same = position_ids.shape[-1] == expected.shape[-1] and torch.equal(
            position_ids.expand_as(expected), expected
        )
        if not same:
            raise ValueError(
                "The model was not given the batch's position_ids: under context parallelism each rank "
                "holds two separate chunks of every sequence (and packed documents restart at 0), so "
                "positions counted from 0 over the local tokens are wrong. Call the model with "
                "position_ids=batch['position_ids']."
            )
    batch.positions_checked = True
