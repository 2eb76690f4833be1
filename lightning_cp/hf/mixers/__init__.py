"""Token mixers that are not softmax attention, made exact under context parallelism, for stock ``transformers``.

A hybrid model (Qwen3.5, Qwen3-Next, Nemotron-H, Granite-4.0-H, Kimi-Linear, LFM2) interleaves attention
with layers that carry a state or a window along the sequence: Gated DeltaNet, Kimi Delta Attention, Mamba2,
short convolutions. Each rank holds two chunks of every sequence, so such a layer run on the shard sees a
part of the sequence (and ``transformers``' torch paths run a packed row as one sequence, so a document's
state flows into the next). :func:`adapt_token_mixers` gives every such layer of a model a forward that,
when the call carries the batch's ``cp_shard``, runs

1. the layer's own projections (and whatever it computes per token) on this rank's tokens;
2. the head-parallel exchange (:mod:`lightning_cp.parallel.head_parallel`): every token of the sequences for
   ``1 / cp`` of the heads (or channels), the heads a rank's value heads read (key heads, B/C groups)
   replicated where there are fewer of them than ranks;
3. the layer's own convolution and scan kernels (the modeling module's ``causal_conv1d_fn``,
   ``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``: the torch ones
   on the CPU, ``fla`` / ``causal-conv1d`` / ``mamba-ssm`` where ``transformers`` finds them) on each sequence
   alone, with the per-head parameters (convolution rows, ``A``, ``D``, ``dt_bias``) sliced to this rank's
   heads, so their gradients reach the whole tensors;
4. the exchange back, then the layer's own gated norm and output projection on this rank's tokens.

Called without ``cp_shard`` (a callback, ``generate``, no strategy) the layer is ``transformers``' own. The
numbers that must divide are checked when the adapters are put in place, and a layer that cannot be split
is refused there by name (the model integration does it at setup, before the first step).

One adapter per mixer kind: :mod:`.delta_rule` (Gated DeltaNet: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid,
Lara-mini; Kimi Delta Attention: Kimi-Linear), :mod:`.mamba2` (Mamba2, Nemotron-H, Granite-4.0-H, Bamba,
Falcon-H1, Zamba2), :mod:`.short_conv` (LFM2, LFM2-MoE, LFM3).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from lightning_cp.adaptation import replace_forward
from lightning_cp.constants import CP_SHARD
from lightning_cp.hf.mixers import delta_rule, mamba2, short_conv
from lightning_cp.hf.mixers._adapter import MixerAdapter
from lightning_cp.hf.mixers.kinds import MixerShape

ADAPTERS: dict[str, MixerAdapter] = {**delta_rule.ADAPTERS, **mamba2.ADAPTERS, **short_conv.ADAPTERS}
"""The adapter of each mixer class, by class name."""

REFUSED: dict[str, str] = dict.fromkeys(
    ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"),
    "is a state-space (Mamba) layer, whose recurrence over the sequence would see one shard: Mamba1 has no "
    "context-parallel forward in lightning_cp (its x_proj mixes every channel of a token, so its channels cannot "
    "be split over the ranks as Mamba2's heads are)",
)
"""Token mixer classes that no adapter makes exact under CP, by class name: why (the end of a sentence that
starts with the module's name). Refused from the model's structure alone, before any weights are read."""


def mixer_shape(module: nn.Module) -> MixerShape | None:
    """``module``'s :class:`~lightning_cp.hf.mixers.kinds.MixerShape` if :data:`ADAPTERS` knows its class (its
    sizes, split rule and plan terms), else ``None``. Reads sizes only: a ``meta`` build will do."""
    adapter = ADAPTERS.get(type(module).__name__)
    return None if adapter is None else adapter.shape(module)


def adapt_token_mixers(model: nn.Module, cp: int) -> list[str]:
    """Give every token mixer of ``model`` that :data:`ADAPTERS` knows the context-parallel forward of this
    module's docstring (once; the model's parameters and their names do not change).

    Returns:
        The names of the adapted modules.

    Raises:
        ValueError: a mixer whose heads (or channels) do not split over ``cp`` ranks, naming the module, the
            config value and ``cp``.
    """
    check_token_mixers_split(model, cp)
    adapted = []
    for name, module in model.named_modules():
        if type(module).__name__ not in ADAPTERS:
            continue
        replace_forward(module, "token_mixer", _forward)
        adapted.append(name)
    return adapted


def check_token_mixers_split(model: nn.Module, cp: int) -> None:
    """Raise if a token mixer of ``model`` that :data:`ADAPTERS` knows cannot be split over ``cp`` ranks. Reads
    the modules' sizes only (a ``meta`` build will do); changes nothing.

    Raises:
        ValueError: the first such mixer, naming the module, its numbers and ``cp``.
    """
    for name, module in model.named_modules():
        shape = mixer_shape(module)
        problem = None if shape is None else shape.split_problem(cp)
        if problem is not None:
            raise ValueError(
                f"{name} ({type(module).__name__}) cannot be split over cp={cp} ranks: {problem}. Use a cp that "
                "divides these numbers."
            )


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
    """The adapted mixer's forward: the adapter's with the batch's shard, ``transformers``' own without."""
    shard = kwargs.pop(CP_SHARD, None)
    if shard is None:
        return type(self).forward(self, *args, **kwargs)
    hidden = args[0] if args else kwargs.pop("hidden_states")
    cache = kwargs.get("cache", kwargs.get("cache_params", args[1] if len(args) > 1 else None))
    mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
    name = type(self).__name__
    if cache is not None:
        raise ValueError(
            f"{name} was called with cp_shard and a cache: a cache of a shard cannot be continued. Call the "
            "model on a batch's shard with use_cache=False."
        )
    if mask is not None and shard.masks_tokens(mask):
        raise ValueError(
            f"{name} got a padding mask with cp_shard; the shard already defines the sequences. Do not pass "
            "attention_mask to the model (pad on the right and mark targets with loss_mask, or pack documents "
            "with cu_seqlens)."
        )
    return ADAPTERS[name].forward(self, hidden, shard)
