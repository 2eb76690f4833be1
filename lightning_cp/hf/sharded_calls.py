"""Calls of a ``transformers`` model on a batch's shard, checked before any layer runs.

:func:`guard_sharded_calls` hooks every ``transformers`` model of a module so that a call on a shard without
the batch's ``cp_shard`` (which would attend within one rank's tokens), or with ``cp_shard`` and a padding mask
that masks a token, is refused on every rank alike, and a call with ``cp_shard`` keeps no KV cache.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from torch import Tensor, nn

from lightning_cp.adaptation import add_hooks
from lightning_cp.constants import CP_SHARD
from lightning_cp.parallel.sharding import sharded_under_cp

WITHOUT_SHARD = (
    "The model was called on a batch sharded for context parallelism without its shard: each rank would "
    "attend only within its own tokens. Pass the batch's shard with its position_ids: "
    "model(input_ids=batch['input_ids'], position_ids=batch['position_ids'], cp_shard=batch['cp_shard'])."
)
"""Why a call on a batch's shard without its ``cp_shard`` is refused, and what to pass."""

MASK_WITH_SHARD = (
    'attn_implementation="lightning_cp" got an attention mask with cp_shard; the shard already defines '
    "causality and document boundaries. Do not pass attention_mask to the model (pad on the right and mark "
    "targets with loss_mask, or pack documents with cu_seqlens instead)."
)
"""Why a call with ``cp_shard`` and a mask that masks a token is refused, and what to do instead."""


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
        if isinstance(model, modeling.PreTrainedModel):
            add_hooks(model, "sharded_calls", pre=_guard_sharded_call, with_kwargs=True)


def _guard_sharded_call(
    module: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    cp_shard = kwargs.get(CP_SHARD)
    if cp_shard is None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if sharded_under_cp(input_ids):
            raise ValueError(f"{type(module).__name__}: {WITHOUT_SHARD}")
        return None
    mask = _argument(type(module), "attention_mask", args, kwargs)
    if isinstance(mask, Tensor) and (mask.dim() != 2 or cp_shard.masks_tokens(mask)):
        raise ValueError(f"{type(module).__name__}: {MASK_WITH_SHARD}")
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
