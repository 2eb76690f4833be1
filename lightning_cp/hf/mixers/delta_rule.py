"""Delta-rule linear attention under CP: Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-Hybrid, Lara-mini) and
Kimi Delta Attention (Kimi-Linear, Bailing-Hybrid).

The layer projects its tokens to ``q``, ``k`` (``Hk`` key heads of ``dk``), ``v`` (``Hv`` value heads of
``dv``), a decay ``g`` (per value head, or per channel for KDA) and a write strength ``beta``; a causal
depthwise convolution runs over the channels of ``[q | k | v]``, then the chunked delta rule over the
sequence, then a gated norm per head and the output projection. Everything but the convolution and the
delta rule is per token, so it runs on this rank's tokens with the layer's own modules; ``q``, ``k``,
``v``, ``g`` and ``beta`` go to the heads (value heads ``Hv / cp`` per rank, the key heads they read with
them, several ranks sharing a key head when ``Hk < cp``), the convolution rows of those heads and the
modeling module's kernel run on whole sequences, and the output comes back before the gated norm.

Sizes and split rule: :class:`~lightning_cp.hf.mixers.kinds.GatedDeltaNetShape`,
:class:`~lightning_cp.hf.mixers.kinds.KDAShape`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_cp.hf.mixers._adapter import channel_rows, depthwise_conv, kernels, tokens
from lightning_cp.hf.mixers.kinds import GatedDeltaNetShape, KDAShape
from lightning_cp.parallel.head_parallel import (
    for_each_sequence,
    head_slices,
    shared_heads,
    to_heads,
    to_tokens,
)
from lightning_cp.parallel.shard import CPShard


@dataclass
class _Projected:
    """A layer's per-token quantities on this rank's ``[B, S]`` tokens."""

    q: Tensor  # [B, S, Hk * dk]
    k: Tensor  # [B, S, Hk * dk]
    v: Tensor  # [B, S, Hv * dv]
    g: Tensor  # [B, S, Hv] (Gated DeltaNet) or [B, S, Hv, dk] (KDA), fp32
    beta: Tensor  # [B, S, Hv]
    gate: Tensor  # [B, S, Hv, dv]: the output norm's gate


@dataclass(frozen=True)
class DeltaRuleAdapter:
    """One family's projections and output around the shared exchange, convolution and delta rule."""

    shape: Callable[[nn.Module], GatedDeltaNetShape | KDAShape]
    """The layer's heads and head dims (:mod:`.kinds`), read from the module."""
    project: Callable[[nn.Module, Tensor], _Projected]
    finish: Callable[[nn.Module, Tensor, Tensor], Tensor]
    """``(module, out [B, S, Hv, dv], gate [B, S, Hv, dv]) -> [B, S, hidden]``."""
    kernel: str
    """The modeling module's chunked delta rule (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``)."""

    def forward(self, module: nn.Module, hidden_states: Tensor, shard: CPShard) -> Tensor:
        shape = self.shape(module)
        hk, hv, dk, dv = shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
        cp, rank = shard.split.cp_size, shard.split.cp_rank
        p = self.project(module, hidden_states)
        values = head_slices(hv, cp, "value heads")
        keys = shared_heads(values, hv, hk, "key heads")
        decay = p.g.shape[-1] if p.g.dim() == 4 else 1
        q, k, v, g, beta = to_heads(
            shard,
            (tokens(p.q, dk), keys),
            (tokens(p.k, dk), keys),
            (tokens(p.v, dv), values),
            (tokens(p.g, decay), values),
            (tokens(p.beta, 1), values),
        )
        rows = shard.device_index(
            torch.cat(
                [
                    channel_rows(keys[rank], dk),
                    channel_rows(keys[rank], dk, hk * dk),
                    channel_rows(values[rank], dv, 2 * hk * dk),
                ]
            )
        )
        kernel = getattr(kernels(module), self.kernel)

        def mix(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
            q, k, v = depthwise_conv(module, module.conv1d, rows, module.activation, q, k, v)
            out, _ = kernel(
                q,
                k,
                v,
                g=g if decay > 1 else g.squeeze(-1),
                beta=beta.squeeze(-1),
                initial_state=None,
                output_final_state=False,
                use_qk_l2norm_in_kernel=True,
            )
            return out  # [n, L, Hv / cp, dv]

        out = to_tokens(shard, for_each_sequence(shard, mix, q, k, v, g, beta))  # [T_local, Hv, dv]
        return self.finish(module, out.reshape(*hidden_states.shape[:2], hv, dv), p.gate)


def _gdn_gates(module: nn.Module, b: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet's ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32)."""
    return b.sigmoid(), -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)


def _qwen3_5(module: nn.Module, h: Tensor) -> _Projected:
    q, k, v = module.in_proj_qkv(h).split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    beta, g = _gdn_gates(module, module.in_proj_b(h), module.in_proj_a(h))
    gate = module.in_proj_z(h).unflatten(-1, (-1, module.head_v_dim))
    return _Projected(q, k, v, g, beta, gate)


def _qwen3_next(module: nn.Module, h: Tensor) -> _Projected:
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(h), module.in_proj_ba(h))
    beta, g = _gdn_gates(module, b, a)
    return _Projected(q.flatten(2), k.flatten(2), v.flatten(2), g, beta, z)


def _olmo_hybrid(module: nn.Module, h: Tensor) -> _Projected:
    beta, g = _gdn_gates(module, module.b_proj(h), module.a_proj(h))
    if module.allow_neg_eigval:
        beta = beta * 2.0
    gate = module.g_proj(h).unflatten(-1, (-1, module.head_v_dim))
    return _Projected(module.q_proj(h), module.k_proj(h), module.v_proj(h), g, beta, gate)


def _kimi(module: nn.Module, h: Tensor) -> _Projected:
    gate = module.g_b_proj(module.g_a_proj(h)).unflatten(-1, (-1, module.head_dim))
    beta = torch.sigmoid(module.b_proj(h))
    return _Projected(module.q_proj(h), module.k_proj(h), module.v_proj(h), module.forget_gate(h), beta, gate)


def _bailing(module: nn.Module, h: Tensor) -> _Projected:
    gate = module.g_proj(h).unflatten(-1, (-1, module.head_dim))
    beta = torch.sigmoid(module.b_proj(h))
    return _Projected(module.q_proj(h), module.k_proj(h), module.v_proj(h), module.forget_gate(h), beta, gate)


def _norm_then(norm: str, projection: str) -> Callable[[nn.Module, Tensor, Tensor], Tensor]:
    """The output of a layer whose gated norm ``norm`` takes ``[tokens * heads, dv]`` and the gate alike."""

    def finish(module: nn.Module, out: Tensor, gate: Tensor) -> Tensor:
        dv = out.shape[-1]
        normed = getattr(module, norm)(out.reshape(-1, dv), gate.reshape(-1, dv))
        return getattr(module, projection)(normed.reshape(*out.shape[:2], -1))

    return finish


def _kda_finish(module: nn.Module, out: Tensor, gate: Tensor) -> Tensor:
    return module.o_proj(module.o_norm(out, gate).flatten(2))


def _gated_deltanet_shape(module: nn.Module) -> GatedDeltaNetShape:
    return GatedDeltaNetShape(module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim)


def _kda_shape(module: nn.Module) -> KDAShape:
    return KDAShape(module.num_heads, module.head_dim)


_GATED_DELTANET = DeltaRuleAdapter(
    _gated_deltanet_shape, _qwen3_5, _norm_then("norm", "out_proj"), "torch_chunk_gated_delta_rule"
)
ADAPTERS = {
    "Qwen3_5GatedDeltaNet": _GATED_DELTANET,
    "Qwen3_5MoeGatedDeltaNet": _GATED_DELTANET,
    "Qwen4ExpTextGatedDeltaNet": _GATED_DELTANET,
    "LaraMiniGatedDeltaNet": _GATED_DELTANET,
    "Qwen3NextGatedDeltaNet": DeltaRuleAdapter(
        _gated_deltanet_shape, _qwen3_next, _norm_then("norm", "out_proj"), "torch_chunk_gated_delta_rule"
    ),
    "OlmoHybridGatedDeltaNet": DeltaRuleAdapter(
        _gated_deltanet_shape, _olmo_hybrid, _norm_then("o_norm", "o_proj"), "torch_chunk_gated_delta_rule"
    ),
    "KimiLinearDeltaAttention": DeltaRuleAdapter(
        _kda_shape, _kimi, _kda_finish, "chunk_kimi_delta_attention"
    ),
    "BailingHybridDeltaAttention": DeltaRuleAdapter(
        _kda_shape, _bailing, _kda_finish, "chunk_kimi_delta_attention"
    ),
}
"""The Gated DeltaNet and KDA adapters, by mixer class name."""
