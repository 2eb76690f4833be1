"""The strategy's static checks: attention that would see only this rank's shard, and configs a probe misses.

The behavioural probe (:mod:`lightning_cp.hf.probe`) decides whether a model is exact under CP; these
checks run before it, for what a short probe cannot show or to name the fix more precisely.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_cp.constants import ATTN_IMPLEMENTATION
from lightning_cp.hf.mixers import REFUSED, check_token_mixers_split
from lightning_cp.hf.sparse_kinds import REFUSED as REFUSED_INDEXERS

# RoPE scalings whose frequencies depend on the longest position a forward sees (transformers'
# dynamic_rope_update): under CP no rank sees the whole sequence, and the padding CP adds moves it.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_attention_is_context_parallel(model: nn.Module, cp: int) -> None:
    """Raise if ``cp > 1`` and ``model`` holds attention layers that attend only within the local shard.

    Under context parallelism every rank holds two chunks of each sequence; an attention layer that is
    not CP-aware trains without any error but on the wrong attention. Flagged: ``transformers`` modules
    whose config's ``_attn_implementation`` is not ``"lightning_cp"`` (one entry per config), and
    :class:`torch.nn.MultiheadAttention`. The package's own models, which call
    :func:`~lightning_cp.parallel.context_parallel_attention`, pass. Local, no communication.

    Raises:
        ValueError: naming the offending modules and what to set instead.
    """
    if cp == 1:
        return
    found, own_attention, seen = [], [], set()
    for name, module in model.named_modules():
        where = name or type(model).__name__
        if isinstance(module, nn.MultiheadAttention):
            found.append(f"{where} (torch.nn.MultiheadAttention)")
        config = getattr(module, "config", None)
        if id(config) in seen or not hasattr(config, "_attn_implementation"):
            continue
        seen.add(id(config))
        implementation = config._attn_implementation
        if implementation == ATTN_IMPLEMENTATION:
            continue
        if getattr(type(module), "_supports_attention_backend", True) is False:
            own_attention.append(f"{where} ({type(module).__name__})")
        else:
            found.append(f"{where} (transformers attn_implementation={implementation!r})")
    if own_attention:
        raise ValueError(
            f"Under context parallelism (cp={cp}) attention must reach the tokens of the other CP ranks, but "
            f"{', '.join(own_attention)} computes attention in classes of its own, not through transformers' "
            "attention interface (its _supports_attention_backend is False), so no attn_implementation can "
            "make it context-parallel. Train this model with cp=1."
        )
    if found:
        raise ValueError(
            f"Under context parallelism (cp={cp}) attention must reach the tokens of the other CP ranks, but "
            f"these modules attend only within this rank's shard: {', '.join(found)}. Build Hugging Face "
            f'models with attn_implementation="{ATTN_IMPLEMENTATION}" (from_pretrained / from_config, or '
            f'model.set_attn_implementation("{ATTN_IMPLEMENTATION}")), and compute other attention with '
            "lightning_cp.parallel.context_parallel_attention."
        )


def check_config_is_context_parallel(model: nn.Module, where: str, cp: int) -> None:
    """Raise if the config of the ``transformers`` model ``model`` sets something the CP path would change.

    A probe of a few dozen tokens cannot reach what only long sequences trigger, so these are read from
    the (text) config: under ``cp > 1``, RoPE of type ``dynamic`` or ``longrope`` (their frequencies
    follow the largest position a forward sees, which differs per rank) and chunked attention
    (``attention_chunk_size``, whose mask the CP kernels do not compute); on any CP size, attention dropout
    in a model built with ``"lightning_cp"`` (the CP kernels have none). Local, no communication.

    Raises:
        ValueError: naming ``where``, the config attribute, its value and what to set instead.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    name = f"{where} ({type(model).__name__})"
    if getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION:
        for attribute, value in vars(config).items():
            if _is_attention_dropout(attribute) and isinstance(value, int | float) and value > 0:
                raise ValueError(
                    f'{name}: attn_implementation="{ATTN_IMPLEMENTATION}" has no attention dropout, but the '
                    f"config sets {attribute}={value}: set {attribute}=0.0."
                )
    if cp == 1:
        return
    for rope_type in _rope_types(config):
        if any(kind in rope_type for kind in _LENGTH_DEPENDENT_ROPE):
            raise ValueError(
                f"{name}: its RoPE of type {rope_type!r} (config rope_parameters) recomputes its frequencies "
                f"from the largest position a forward sees; under context parallelism (cp={cp}) each rank sees "
                "other positions (and the padding CP adds), so ranks would rotate with other frequencies than "
                "the unsharded model. Use a RoPE scaling that does not depend on the sequence length "
                "(default, linear, llama3, yarn), or cp=1."
            )
    if getattr(config, "attention_chunk_size", None):
        raise ValueError(
            f"{name}: chunked attention (config attention_chunk_size={config.attention_chunk_size}) is a mask "
            f"context-parallel attention does not compute (cp={cp}). Set attention_chunk_size=None, or use cp=1."
        )


def check_token_mixers(model: nn.Module, where: str, cp: int) -> None:
    """Raise if a token mixer of the ``transformers`` model ``model`` cannot train exactly under ``cp`` ranks: a
    class no adapter makes context-parallel (:data:`~lightning_cp.hf.mixers.REFUSED`: Mamba1; the sparse-attention
    indexers of :data:`~lightning_cp.hf.sparse_kinds.REFUSED`) under ``cp > 1``,
    or an adapted mixer whose heads do not split over ``cp``
    (:func:`~lightning_cp.hf.mixers.check_token_mixers_split`). Reads the module classes and sizes only (a
    ``meta`` build will do). Local, no communication.

    Raises:
        ValueError: naming ``where``, the module and why, with the numbers.
    """
    name = f"{where} ({type(model).__name__})"
    if cp > 1:
        for module_name, module in model.named_modules():
            reason = REFUSED.get(type(module).__name__) or REFUSED_INDEXERS.get(type(module).__name__)
            if reason is not None:
                raise ValueError(
                    f"{name}: {module_name} ({type(module).__name__}) {reason}. lightning_cp's CP cannot train "
                    f"this model exactly (cp={cp}): train it with cp=1."
                )
    try:
        check_token_mixers_split(model, cp)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def _is_attention_dropout(attribute: str) -> bool:
    lower = attribute.lower()
    return ("attn" in lower or "attention" in lower) and ("dropout" in lower or "pdrop" in lower)


def _rope_types(config: Any) -> list[str]:
    """Every RoPE type of ``config``: ``rope_parameters`` (or the older ``rope_scaling``), per layer type too."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(parameters, dict):
        return []
    groups = [parameters] if "rope_type" in parameters or "type" in parameters else list(parameters.values())
    return [str(g.get("rope_type", g.get("type", ""))) for g in groups if isinstance(g, dict)]
