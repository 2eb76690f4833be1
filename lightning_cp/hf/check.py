"""The strategy's guard against attention that would silently see only this rank's shard under CP."""

from __future__ import annotations

from torch import nn

from lightning_cp.hf.attention import ATTN_IMPLEMENTATION


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
    found, seen = [], set()
    for name, module in model.named_modules():
        where = name or type(model).__name__
        if isinstance(module, nn.MultiheadAttention):
            found.append(f"{where} (torch.nn.MultiheadAttention)")
        config = getattr(module, "config", None)
        if id(config) in seen or not hasattr(config, "_attn_implementation"):
            continue
        seen.add(id(config))
        implementation = config._attn_implementation
        if implementation != ATTN_IMPLEMENTATION:
            found.append(f"{where} (transformers attn_implementation={implementation!r})")
    if found:
        raise ValueError(
            f"Under context parallelism (cp={cp}) attention must reach the tokens of the other CP ranks, but "
            f"these modules attend only within this rank's shard: {', '.join(found)}. Build Hugging Face "
            f'models with attn_implementation="{ATTN_IMPLEMENTATION}" (from_pretrained / from_config, or '
            f'model.set_attn_implementation("{ATTN_IMPLEMENTATION}")), and compute other attention with '
            "lightning_cp.parallel.context_parallel_attention."
        )
