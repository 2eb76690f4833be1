"""Mamba2 under CP: Mamba2, Nemotron-H, Granite-4.0-H (GraniteMoeHybrid), Bamba, Falcon-H1, Zamba2.

The layer projects its tokens to ``[gate | x | B | C | dt]`` (``x`` of ``H`` heads of ``P``, ``B`` and ``C`` of
``G`` groups of the state size ``N``, ``dt`` per head); a causal depthwise convolution runs over the channels
of ``[x | B | C]``, then the chunked SSD scan with ``A``, ``D`` and ``dt_bias`` per head, head ``h`` reading
group ``h // (H / G)``; then the gated RMS norm (over groups of heads, so after the exchange back) and the
output projection. ``x`` and ``dt`` go to the heads (``H / cp`` per rank), ``B`` and ``C`` with the groups
those heads read (replicated when ``G < cp``: Granite-4.0-H and Bamba have ``G = 1``); the convolution rows of
those channels and the modeling module's ``mamba2_chunk_scan`` run on whole sequences with ``A``, ``D``,
``dt_bias`` sliced to the rank's heads. Falcon-H1's multipliers (``ssm_in_multiplier``, ``mup_vector``) are
per token and its norm optional, as in its own forward.

Sizes and split rule: :class:`~lightning_cp.hf.mixers.kinds.Mamba2Shape`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_cp.hf.mixers._adapter import channel_rows, depthwise_conv, kernels, tokens
from lightning_cp.hf.mixers.kinds import Mamba2Shape
from lightning_cp.parallel.head_parallel import (
    for_each_sequence,
    head_slices,
    shared_heads,
    to_heads,
    to_tokens,
)
from lightning_cp.parallel.shard import CPShard


class Mamba2Adapter:
    """The context-parallel forward of ``transformers``' Mamba2 mixers (the attributes of ``Mamba2Mixer``)."""

    def shape(self, module: nn.Module) -> Mamba2Shape:
        return Mamba2Shape(
            module.num_heads, module.head_dim, module.n_groups, module.ssm_state_size, module.chunk_size
        )

    def forward(self, module: nn.Module, hidden_states: Tensor, shard: CPShard) -> Tensor:
        shape = self.shape(module)
        heads, dim, groups, state = shape.heads, shape.head_dim, shape.groups, shape.state
        inner = module.intermediate_size
        cp, rank = shard.split.cp_size, shard.split.cp_rank
        dtype = hidden_states.dtype
        if hasattr(module, "ssm_in_multiplier"):  # Falcon-H1
            hidden_states = hidden_states * module.ssm_in_multiplier
        projected = module.in_proj(hidden_states)
        if hasattr(module, "mup_vector"):
            projected = projected * module.mup_vector
        gate, x, b, c, dt = projected.split([inner, inner, groups * state, groups * state, heads], dim=-1)
        mine = head_slices(heads, cp, "heads")
        read = shared_heads(mine, heads, groups, "groups")
        x, b, c, dt = to_heads(
            shard,
            (tokens(x, dim), mine),
            (tokens(b, state), read),
            (tokens(c, state), read),
            (tokens(dt, 1), mine),
        )
        rows = shard.device_index(
            torch.cat(
                [
                    channel_rows(mine[rank], dim),
                    channel_rows(read[rank], state, inner),
                    channel_rows(read[rank], state, inner + groups * state),
                ]
            )
        )
        own = shard.device_index(mine[rank])
        a = -torch.exp(module.A_log.float()).index_select(0, own)

        def mix(x: Tensor, b: Tensor, c: Tensor, dt: Tensor) -> Tensor:
            x, b, c = depthwise_conv(module, module.conv1d, rows, module.activation, x, b, c)
            return kernels(module).mamba2_chunk_scan(
                x,
                dt.squeeze(-1),
                a,
                b,
                c,
                chunk_size=shape.chunk,
                D=module.D.index_select(0, own),
                z=None,
                dt_bias=module.dt_bias.index_select(0, own),
                dt_softplus=True,
                dt_limit=module.time_step_limit,
            )  # [n, L, H / cp, P]

        out = to_tokens(shard, for_each_sequence(shard, mix, x, b, c, dt)).reshape(
            *hidden_states.shape[:2], inner
        )
        if getattr(module, "mamba_rms_norm", True):
            out = module.norm(out, gate)
        else:  # Falcon-H1 without its norm
            out = out * F.silu(gate)
        return module.out_proj(out.to(dtype))


_MAMBA2 = Mamba2Adapter()
ADAPTERS = {
    name: _MAMBA2
    for name in (
        "Mamba2Mixer",
        "NemotronHMamba2Mixer",
        "GraniteMoeHybridMambaLayer",
        "BambaMixer",
        "FalconH1Mixer",
        "Zamba2MambaMixer",
    )
}
"""The Mamba2 adapter, by mixer class name."""
