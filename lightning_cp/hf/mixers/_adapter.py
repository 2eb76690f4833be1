"""What every mixer adapter shares: its interface, the modeling module's kernels, the depthwise convolution."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Protocol

import torch
from torch import Tensor, nn

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
    module: nn.Module, conv: nn.Conv1d, x: Tensor, rows: Tensor, activation: str | None
) -> Tensor:
    """The layer's causal depthwise convolution of ``x`` ``[n, L, C_r]`` over its channels ``rows`` (of
    ``conv``'s), through the modeling module's ``causal_conv1d_fn``: ``[n, L, C_r]``."""
    rows = rows.to(x.device)
    weight = conv.weight.squeeze(1).index_select(0, rows)
    bias = None if conv.bias is None else conv.bias.index_select(0, rows)
    out = kernels(module).causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation=activation)
    return out[:, :, : x.shape[1]].transpose(1, 2)
