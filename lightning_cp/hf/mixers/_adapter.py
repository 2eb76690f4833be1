"""What every mixer adapter shares: its interface, the modeling module's kernels, the depthwise convolution,
the split check."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Protocol

import torch
from torch import Tensor, nn

from lightning_cp.parallel.head_parallel import head_slices, shared_heads
from lightning_cp.parallel.sharding import CPShard


class MixerAdapter(Protocol):
    """The context-parallel forward of one kind of token mixer."""

    def split_problem(self, module: nn.Module, cp: int) -> str | None:
        """Why ``module``'s heads (or channels) cannot be split over ``cp`` ranks, with the numbers; ``None``
        when they can."""

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
    out = kernels(module).causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation=activation)
    out = out[:, :, : x.shape[1]].transpose(1, 2)
    widths = [part[0, 0].numel() for part in parts]
    return [y.reshape(part.shape) for y, part in zip(out.split(widths, dim=-1), parts, strict=True)]


def head_split_problem(heads: int, shared: int, cp: int, heads_name: str, shared_name: str) -> str | None:
    """Why ``heads`` (and the ``shared`` heads they read: key heads, B/C groups) cannot be split over ``cp``
    ranks (:func:`~lightning_cp.parallel.head_parallel.shared_heads`), with the numbers; ``None`` if they can."""
    try:
        shared_heads(head_slices(heads, cp, heads_name), heads, shared, shared_name)
    except ValueError as error:
        return str(error)
    return None
