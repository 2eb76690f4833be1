"""What one decoder layer saves for its backward, per local token: the plan's activation terms.

Each function counts the tensors autograd keeps in the package GPT and in a ``transformers`` Llama-style layer,
as ``tests/plan/test_measured.py`` measures them (see docs/design.md, "Memory plan"): the attention side (the
first norm, the queries' and keys' norms, the attention's tensors) and the MLP side (the second norm, the MLP or
the mixture of experts), tiled or not, in the stream's and the compute dtypes.
"""

from __future__ import annotations

import math
from typing import Literal

from lightning_cp.plan.shape import ModelShape

Precision = Literal["bf16-mixed", "bf16-true", "32-true"]
PRECISIONS: tuple[Precision, ...] = ("bf16-mixed", "bf16-true", "32-true")


def local_tokens(seq_len: int, cp: int) -> int:
    """Tokens on one CP rank: the sequence padded to a multiple of ``2 * cp``, over ``cp``."""
    return math.ceil(seq_len / (2 * cp)) * 2


def saved_per_token(
    shape: ModelShape,
    *,
    cp: int = 1,
    tiled: bool = False,
    ulysses: bool = False,
    residual_bytes: int = 4,
    compute_bytes: int = 4,
) -> int:
    """Bytes one decoder layer saves for backward per local token: its :func:`attention_side_per_token` and
    its :func:`mlp_side_per_token`.

    ``residual_bytes``: the residual stream's dtype (fp32 under DDP's ``bf16-mixed``, where the embedding
    is fp32; bf16 under FSDP's, whose gathered bf16 weights make every hidden state bf16; see
    :func:`residual_bytes`); ``compute_bytes``: the projections' inputs and the attention's and the MLP's
    tensors. Per layer, ``d`` the hidden size:

    - two norms: each keeps an fp32 copy of its input (the input itself when the stream is fp32), the
      reciprocal RMS and the normalized input in the stream's dtype (:func:`norm_bytes`), and its output,
      which the next projections read, in the compute dtype; tiled (``tiled``:
      :func:`~lightning_cp.memory.tile_model`), only its input, and neither output: the projections and the
      tiled MLP that read them recompute them, but a mixture of experts' router keeps the second's;
    - attention of a ``transformers`` layer: the rotated ``q`` and ``k`` (token-major copies under CP),
      ``v`` (the projection's output), the attention output (which the output projection reads in place)
      and the log-sum-exp per head;
    - attention of the package GPT: the same, but ``v`` is a view of the fused QKV output, which it keeps
      whole; at ``cp = 1`` (the fused SDPA kernel) also the output's ``[S, heads * D]`` copy for the
      output projection;
    - Ulysses' attention (``ulysses``): the same tensors on the heads' side (every token of ``Hq / cp`` query
      heads and the key/value heads they read, replicated when ``Hkv < cp``: ``max(Hkv, cp)`` heads' worth per
      local token), and the output brought back, which the output projection reads (``q_dim`` more);
    - the queries' and keys' norms (:attr:`~lightning_cp.plan.ModelShape.qk_norm`): like the layer's norms,
      an fp32 copy of their input (the projections' output), the normalized input in the compute dtype and
      the reciprocal RMS per head; tiled, only their input;
    - MLP: GELU's input and output (``2 ffn``), or a gated MLP's gate, up, activation and product
      (``4 ffn``), and a mixture of experts' routed experts (:func:`routed_per_token`); none tiled
      (:func:`~lightning_cp.memory.tile_mlps`), and of a tiled mixture of experts
      (:func:`~lightning_cp.memory.tile_experts`) only the router's own tensors (:func:`router_bytes`).
    """
    dtypes = {"residual_bytes": residual_bytes, "compute_bytes": compute_bytes}
    attention = attention_side_per_token(shape, cp=cp, tiled=tiled, ulysses=ulysses, **dtypes)
    return attention + mlp_side_per_token(shape, tiled=tiled, **dtypes)


def attention_side_per_token(
    shape: ModelShape,
    *,
    cp: int = 1,
    tiled: bool = False,
    ulysses: bool = False,
    residual_bytes: int = 4,
    compute_bytes: int = 4,
) -> int:
    """What :func:`saved_per_token` counts up to the attention's output: the first norm's, the queries' and
    keys' norms' and the attention's tensors."""
    d = shape.hidden
    norm = residual_bytes * d if tiled else norm_bytes(d, residual_bytes) + compute_bytes * d
    # MLA's attention saves the latent and rotary key part (latent_dim), not the expanded keys and values, and
    # takes no all-to-all under Ulysses (lightning_cp.parallel.latent_attention).
    attention = shape.q_dim + shape.out_dim + (shape.latent_dim or shape.kv_dim + shape.v_dim) + shape.heads
    if ulysses and shape.latent_dim is None:
        attention += shape.q_dim + 2 * (max(shape.kv_heads, cp) - shape.kv_heads) * shape.head_dim
    if shape.architecture == "gpt":
        attention += shape.q_dim + shape.kv_dim + (shape.q_dim if cp == 1 else 0)
    return norm + qk_norm_bytes(shape, tiled, compute_bytes) + attention * compute_bytes


def mlp_side_per_token(
    shape: ModelShape,
    *,
    tiled: bool = False,
    residual_bytes: int = 4,
    compute_bytes: int = 4,
) -> int:
    """What :func:`saved_per_token` counts from the second norm on: the second norm's and the MLP's (or the
    mixture of experts') tensors. A layer's backward frees them before its attention's backward begins."""
    d = shape.hidden
    if tiled:
        router = compute_bytes * d + router_bytes(shape, compute_bytes) if shape.experts else 0
        return residual_bytes * d + router
    mlp = (2 if shape.architecture == "gpt" else 4) * shape.ffn + routed_per_token(shape)
    return norm_bytes(d, residual_bytes) + (d + mlp) * compute_bytes


def qk_norm_bytes(shape: ModelShape, tiled: bool, compute_bytes: int) -> int:
    """Bytes the queries' and keys' norms of one attention layer save per token (0 without them): the input
    (the projections' output) when tiled; else, as the layer's norms, an fp32 copy of it, the normalized
    input in the compute dtype and the fp32 reciprocal RMS of every head."""
    if not shape.qk_norm:
        return 0
    normalized = shape.q_dim + shape.kv_dim
    if tiled:
        return normalized * compute_bytes
    return normalized * (4 + compute_bytes) + 4 * (shape.heads + shape.kv_heads)


def norm_bytes(hidden: int, residual_bytes: int) -> int:
    """Bytes an untiled RMSNorm saves per token besides its output: an fp32 copy of its input (the input
    itself in an fp32 stream), the fp32 reciprocal RMS, the normalized input in the stream's dtype."""
    return 4 * hidden + 4 + residual_bytes * hidden


def residual_bytes(precision: Precision, fsdp: bool) -> int:
    """Bytes of one element of the residual stream: the master weights' dtype, but the compute dtype under
    FSDP, which gathers the weights in it (``MixedPrecisionPolicy(param_dtype=bf16)``), so the embedding and
    everything after it are bf16 under ``bf16-mixed``; DDP's autocast leaves the embedding fp32."""
    if precision == "32-true":
        return 4
    return 2 if fsdp or precision == "bf16-true" else 4


def routed_per_token(shape: ModelShape) -> int:
    """Elements a mixture of experts' routed experts save per token (0 for a dense MLP): each of the
    ``top_k`` experts' gated MLP (``4 * expert_ffn``) and the token's copy in and out (``2 * hidden``), the
    router's probabilities, and the routing's own buffers (about ``9 top_k``: index and permutation
    tensors), as ``transformers``' grouped experts save them, measured on the CPU."""
    if not shape.experts:
        return 0
    k = shape.top_k
    return k * (4 * shape.expert_ffn + 2 * shape.hidden + 9) + shape.experts


def router_bytes(shape: ModelShape, compute_bytes: int) -> int:
    """Bytes a tiled mixture of experts saves per token besides the layer's input (0 for a dense MLP): the
    router's fp32 probabilities, its top-k indices (int64) and routing weights (the compute dtype), which the
    tiled experts take as inputs (:func:`~lightning_cp.memory.tile_experts`)."""
    if not shape.experts:
        return 0
    return 4 * shape.experts + (8 + compute_bytes) * shape.top_k
