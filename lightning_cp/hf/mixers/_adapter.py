"""What every mixer adapter shares: its interface, the modeling module's kernels, the depthwise convolution."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Protocol

import torch
from torch import Tensor, nn

from lightning_cp.hf.mixers.kinds import MixerShape
from lightning_cp.parallel.shard import CPShard


class MixerAdapter(Protocol):
    """The context-parallel forward of one kind of token mixer."""

    def shape(self, module: nn.Module) -> MixerShape:
        """``module``'s sizes as its kind describes them (:mod:`.kinds`): what the forward splits, the split
        rule, the plan's terms."""

    def forward(self, module: nn.Module, hidden_states: Tensor, shard: CPShard) -> Tensor:
        """``module``'s output ``[B, S_local, hidden]`` for this rank's tokens ``hidden_states`` of the batch
        ``shard`` describes, equal to the unsharded layer's on the same tokens.

        Communication: one all-to-all over the shard's CP group each way (forward and backward).
        """


def kernels(module: nn.Module) -> ModuleType:
    """The modeling module of ``module``'s class, whose functions (``causal_conv1d_fn``, the scans) the
    adapters call: the model's own kernels, as ``transformers`` resolves them (torch, ``fla``, ...)."""
    return sys.modules[type(module).__module__]


def tokens(x: Tensor, dim: int) -> Tensor:
    """``[B, S, H * dim]`` (or ``[B, S, H, dim]``) -> ``[B * S, H, dim]``: this rank's tokens, token-major."""
    return x.reshape(x.shape[0] * x.shape[1], -1, dim)


def channel_rows(heads: Tensor, width: int, offset: int = 0) -> Tensor:
    """The channels of ``heads`` (``[h]``) of ``width`` each, in a layer of channels starting at ``offset``:
    ``[h * width]`` int64, head after head."""
    return (offset + heads[:, None] * width + torch.arange(width)).flatten()


def depthwise_conv(
    module: nn.Module, conv: nn.Conv1d, rows: Tensor, activation: str | None, *parts: Tensor
) -> list[Tensor]:
    """The layer's causal depthwise convolution of ``parts`` (each ``[n, L, ...]``, whose channels side by
    side are ``conv``'s channels ``rows``, an index on the parts' device: ``shard.device_index``), through
    the modeling module's ``causal_conv1d_fn``: each part's channels convolved, shaped as the part."""
    x = torch.cat([part.flatten(2) for part in parts], dim=-1)  # [n, L, C_r]
    weight = conv.weight.squeeze(1).index_select(0, rows)
    bias = None if conv.bias is None else conv.bias.index_select(0, rows)
    out = kernels(module).causal_conv1d_fn(_conv_input(x), weight, bias, activation=activation)
    out = out[:, :, : x.shape[1]].transpose(1, 2)
    widths = [part[0, 0].numel() for part in parts]
    return [y.reshape(part.shape) for y, part in zip(out.split(widths, dim=-1), parts, strict=True)]


CHANNEL_LAST_MULTIPLE = 8
"""causal-conv1d's CUDA kernel takes a channel-last input (``[n, C, L]`` with unit channel stride) only for a
multiple of this many channels; its channel-first kernel takes any count."""


def _conv_input(x: Tensor) -> Tensor:
    """``x`` ``[n, L, C]`` as the ``[n, C, L]`` input of ``causal_conv1d_fn``: a channel-last view (no copy)
    when ``C`` is a multiple of :data:`CHANNEL_LAST_MULTIPLE`, else a channel-first copy.

    A rank convolves the channels of its heads, ``C`` of them, which need not be a multiple of 8 (a layer's
    channels split over ``cp`` ranks); causal-conv1d's kernel refuses such a channel-last input at the first
    step. Its channel-first kernel computes the same convolution for any ``C``, so the copy keeps the fused
    kernel (and the torch path is indifferent to the layout): exact, one ``[n, C, L]`` copy instead of the
    much slower torch fallback. Decided from the shape alone, so every rank (and a checkpointed layer's
    recomputation) decides alike."""
    channels_first = x.transpose(1, 2)
    if x.shape[-1] % CHANNEL_LAST_MULTIPLE:
        return channels_first.contiguous()
    return channels_first
