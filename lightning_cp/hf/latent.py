"""Multi-head latent attention (MLA) under CP: the latent reaches the attention unexpanded.

Every MLA family of ``transformers`` (DeepSeek-V2/V3/V3.2, GLM-4.7-Flash, GLM-MoE-DSA, Kimi-Linear, LongCat-Flash,
MiniCPM3, Mistral-4, ...) computes, in its attention layer, one normalized latent ``kv_nope`` ``[B, 1, S,
kv_lora_rank]`` and one rotary key part ``k_rot`` ``[B, 1, S, qk_rope_head_dim]`` (rotary applied) per token,
then calls ``self.expand_kv(kv_nope, k_rot)``, which runs ``kv_b_proj`` to every head's key and value, and hands
those to the attention function. Under CP those expanded keys and values would be what is exchanged:
``H * (Dn + Dr + Dv)`` values per token against the latent's ``R + Dr`` (71x at DeepSeek-V3's shape).

:func:`adapt_latent_attention` gives every such layer (a ``kv_b_proj`` and an ``expand_kv``) an ``expand_kv``
that, when the layer's attention is ``"lightning_cp"`` and its ``kv_b_proj`` a plain bias-free ``nn.Linear``,
returns ``(kv_nope, k_rot)`` as they are, ``kv_nope`` tagged with the layer (:data:`LATENT_OF`).
``attn_implementation="lightning_cp"`` (:mod:`lightning_cp.hf.attention`) then

- with the batch's ``cp_shard`` and no sparse selection: runs
  :func:`~lightning_cp.parallel.latent_attention.latent_attention`, which all-gathers the latent and rotary part
  and expands them per round of heads with ``kv_b_proj.weight`` (:func:`attend`), under either attention mode;
- with a DSA selection (``indices``): attends in the absorbed (MQA) form (:func:`attend_selected`): each head's
  query folded through its ``W_k`` into the latent's space, the latent and rotary part one key shared by every
  head whose first ``R`` columns are the values, :func:`~lightning_cp.parallel.sparse_attention.sparse_attention`
  gathering that one ``[T, R + Dr]`` key, and the latent output unfolded through ``W_v``: exact by
  reassociation;
- without ``cp_shard`` (a callback, ``generate``, no strategy): expands the latent with the family's own
  ``expand_kv`` (:func:`expand`) and runs as before.

``kv_b_proj`` is read as one weight ``[H (Dn + Dv), R]`` (:func:`kv_b_weight`): a plain bias-free ``nn.Linear``'s,
or for a ``peft`` LoRA adapter on one (LoRA's default ``"all-linear"`` targets it) the merged ``W + scaling B A``,
differentiable in ``A`` and ``B`` (``W x + scaling B A x`` is ``(W + scaling B A) x``), so an adapted layer still
exchanges its latent (QLoRA's NF4 ``W`` dequantized, as its ``F.linear`` does). Any other ``kv_b_proj`` (an adapter
with dropout, DoRA, a bias) keeps the family's own ``expand_kv``: its keys and values are expanded before the
attention and exchanged as such.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from lightning_cp.adaptation import replace_forward
from lightning_cp.constants import ATTN_IMPLEMENTATION
from lightning_cp.hf.qlora import is_quantized
from lightning_cp.parallel.attention import compute_dtype
from lightning_cp.parallel.latent_attention import latent_attention
from lightning_cp.parallel.shard import CPShard
from lightning_cp.parallel.sparse_attention import sparse_attention

LATENT_OF = "_lightning_cp_latent_of"
"""The attribute the adapted ``expand_kv`` sets on the latent it returns unexpanded: its MLA layer."""


def adapt_latent_attention(model: nn.Module) -> list[str]:
    """Give every MLA attention layer of ``model`` (a ``kv_b_proj`` module and an ``expand_kv`` method) the
    ``expand_kv`` of this module's docstring (once; parameters and names unchanged). No communication.

    Returns:
        The names of the adapted layers.
    """
    adapted = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "kv_b_proj", None), nn.Module) and callable(
            getattr(type(module), "expand_kv", None)
        ):
            replace_forward(module, "latent", _expand_kv, method="expand_kv")
            adapted.append(name)
    return adapted


def latent_layer(key: Tensor) -> nn.Module | None:
    """The MLA layer whose unexpanded latent ``key`` is (:data:`LATENT_OF`), else ``None``."""
    return getattr(key, LATENT_OF, None)


def expand(layer: nn.Module, latent: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
    """The family's own ``expand_kv`` of ``layer``: every head's keys ``[B, H, S, Dn + Dr]`` and values
    ``[B, H, S, Dv]``."""
    return type(layer).expand_kv(layer, latent, k_rot)


def attend(
    layer: nn.Module,
    query: Tensor,
    latent: Tensor,
    k_rot: Tensor,
    cp_shard: CPShard,
    scaling: float | None,
    **variants: Any,
) -> Tensor:
    """:func:`~lightning_cp.parallel.latent_attention.latent_attention` of ``layer``'s queries ``[B, H, S_local,
    Dn + Dr]`` over the latent ``[B, 1, S_local, R]`` and rotary part ``[B, 1, S_local, Dr]`` with its
    ``kv_b_proj.weight``: ``[B, H, S_local, Dv]``. ``variants``: its ``window``, ``softcap``, ``sinks``.

    Communication: one all-gather of ``[T_local, R + Dr]`` over the shard's CP group forward, the same and one
    reduce-scatter backward (none without CP)."""
    return latent_attention(
        query,
        latent,
        k_rot,
        kv_b_weight(layer.kv_b_proj),
        cp_shard=cp_shard,
        value_dim=layer.v_head_dim,
        scale=scaling,
        **variants,
    )


def attend_selected(
    layer: nn.Module,
    query: Tensor,
    latent: Tensor,
    k_rot: Tensor,
    selected: Tensor,
    cp_shard: CPShard,
    scaling: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """DSA in the absorbed (MQA) form: ``layer``'s queries ``[B, H, S_local, Dn + Dr]`` over the ``selected``
    rows (``[B * S_local, n]``, sequence order) of one key per token, ``[latent, k_rot]`` ``[B, 1, S_local, R +
    Dr]``, whose first ``R`` columns are the values: ``q_lat = q_nope @ W_k[h]`` per head (``W_k[h]`` ``[Dn, R]``
    of ``kv_b_proj.weight``), then the output ``o_lat @ W_v[h]^T`` ``[B, H, S_local, Dv]``. Scores and outputs
    are those of the expanded keys and values (reassociated products).

    Communication: that of :func:`~lightning_cp.parallel.sparse_attention.sparse_attention` with one key head
    of ``R + Dr`` and no values (all-gathered forward and backward, its gradient reduce-scattered)."""
    rank, nope = latent.shape[-1], query.shape[-1] - k_rot.shape[-1]
    rows = kv_b_weight(layer.kv_b_proj).view(query.shape[1], -1, rank)  # [H, Dn + Dv, R]
    folded = torch.einsum("bhsn,hnr->bhsr", query[..., :nope], rows[:, :nope].to(query.dtype))
    q = torch.cat([folded, query[..., nope:]], dim=-1)
    k = torch.cat([latent, k_rot], dim=-1)
    dtype = compute_dtype(q, k, k)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    autocast = torch.is_autocast_enabled(q.device.type)
    # As context_parallel_attention: the kernel's inputs in one dtype, its einsums outside autocast.
    with torch.autocast(q.device.type, enabled=False) if autocast else contextlib.nullcontext():
        out = sparse_attention(
            q.to(dtype), k.to(dtype), None, selected, cp_shard, scale, sinks, value_dim=rank
        )
    return torch.einsum("bhsr,hvr->bhsv", out, rows[:, nope:].to(out.dtype))


def kv_b_weight(projection: nn.Module) -> Tensor:
    """``kv_b_proj``'s weight ``[H (Dn + Dv), R]`` as one tensor, for a ``projection`` :func:`_merged_adapters`
    reads: a plain bias-free ``nn.Linear``'s own; for a ``peft`` LoRA layer on one, ``W + sum_a scaling_a B_a A_a``
    over its active adapters (``W`` alone when merged or disabled), in the adapters' dtype where wider, its
    gradient reaching ``A`` and ``B``; ``W`` dequantized when QLoRA stores it as NF4. Local, no communication."""
    adapters = _merged_adapters(projection)
    if adapters is None:
        raise ValueError(f"{type(projection).__name__} is not read as one weight (see _merged_adapters)")
    base = projection.get_base_layer() if hasattr(projection, "lora_A") else projection
    # QLoRA's frozen NF4 weight, dequantized as its F.linear dequantizes it (to its original dtype).
    weight = base.weight.get_original_weight() if is_quantized(base.weight) else base.weight
    for name in adapters:
        delta = projection.scaling[name] * (projection.lora_B[name].weight @ projection.lora_A[name].weight)
        weight = weight.to(torch.promote_types(weight.dtype, delta.dtype)) + delta  # [out, R]
    return weight


def _merged_adapters(projection: nn.Module) -> list[str] | None:
    """The LoRA adapters :func:`kv_b_weight` adds to ``projection``'s base weight (none for a plain bias-free
    ``nn.Linear``, or a ``peft`` layer merged or disabled); ``None`` when ``projection`` is not read as one weight:
    anything else, or an adapter whose output is not ``scaling B A x`` (dropout while training, DoRA, a bias on
    ``B``). Reads the modules only: the check before the forward computes anything."""
    base = projection.get_base_layer() if hasattr(projection, "lora_A") else projection
    if type(base) is not nn.Linear or base.bias is not None:
        return None
    if base is projection or projection.merged or projection.disable_adapters:
        return []
    adapters = [name for name in projection.active_adapters if name in projection.lora_A]
    for name in adapters:
        dropout = projection.lora_dropout[name]
        drops = isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0
        if projection.use_dora.get(name) or projection.lora_B[name].bias is not None or drops:
            return None
    return adapters


def _expand_kv(self: nn.Module, kv_nope: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
    """The adapted ``expand_kv``: ``(kv_nope, k_rot)`` unexpanded, ``kv_nope`` tagged with the layer, when the
    layer's attention is ``"lightning_cp"`` and :func:`kv_b_weight` reads ``kv_b_proj``; else the family's own."""
    ours = getattr(getattr(self, "config", None), "_attn_implementation", None) == ATTN_IMPLEMENTATION
    if not ours or _merged_adapters(self.kv_b_proj) is None:
        return expand(self, kv_nope, k_rot)
    setattr(kv_nope, LATENT_OF, self)
    return kv_nope, k_rot
