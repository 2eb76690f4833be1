"""Context-parallel causal attention, without TransformerEngine, for padded and packed batches: the entry.

Each CP rank holds the queries, keys and values of its own tokens in the load-balanced layout made by
:func:`lightning_cp.parallel.shard_batch` (chunks ``r`` and ``2 * cp - 1 - r`` of every sequence).
:func:`context_parallel_attention` checks its arguments, casts ``q``, ``k``, ``v`` to one compute dtype
and runs the exchange the batch's :class:`~lightning_cp.parallel.CPShard` carries
(:class:`~lightning_cp.parallel.attention_mode.AttentionMode`), one module each:

- the all-gather (:mod:`lightning_cp.parallel._allgather_attention`): every rank keeps its queries and
  all-gathers the key/value heads, in rounds of heads; each layer holds, per round, the whole sequence's
  keys and values of the round's key/value heads during its forward and its backward;
- Ulysses (:mod:`lightning_cp.parallel._ulysses_attention`): one all-to-all to every token of ``Hq / cp``
  query heads and the key/value heads they read, one rank's attention on those whole sequences (their
  keys and values whole too), one all-to-all back;
- without CP (no shard, or one rank), one rank's attention over its own keys, nothing exchanged.

The variable-length kernels (:mod:`lightning_cp.parallel._varlen`: FlashAttention-2 varlen on CUDA, an exact
blocked torch kernel elsewhere) read every piece's keys in place
(:mod:`lightning_cp.parallel._key_selection`). Documents of a packed batch never see each other, and no
``[T_local, T_total]`` mask is ever built. Sliding windows, logit softcapping, attention sinks and a value
head dim of its own are exact on every path.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor

from lightning_cp.parallel import _varlen
from lightning_cp.parallel._allgather_attention import allgather_attention, local_attention
from lightning_cp.parallel._ulysses_attention import ulysses_attention
from lightning_cp.parallel.shard import CPShard
from lightning_cp.parallel.sparse_attention import sparse_attention


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cp_shard: CPShard | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    selected: Tensor | None = None,
) -> Tensor:
    """Causal attention over the whole sequences while each rank holds only its shard.

    Every variant below is exact (the same as on the full sequence, outputs and gradients) for padded and
    packed batches, any CP size, and grouped- or multi-query attention; they combine freely.

    Args:
        q: ``[B, Hq, S_local, D]``, this rank's queries in ``shard_batch``'s layout (any float dtype).
        k: ``[B, Hkv, S_local, D]`` with ``Hkv`` dividing ``Hq`` (grouped- or multi-query attention when
            smaller); on ``q``'s device. ``q``, ``k``, ``v`` are cast to one compute dtype
            (:func:`compute_dtype`: autocast's under autocast, as SDPA does, else the widest of the three),
            in which the kernel is chosen and the keys and values are exchanged.
        v: ``[B, Hkv, S_local, Dv]``; ``Dv`` may differ from ``D`` (DeepSeek's multi-head latent attention).
        cp_shard: the batch's ``batch["cp_shard"]`` from :func:`~lightning_cp.parallel.shard_batch`, which
            carries the CP group the batch was split over (``cp_shard.exchange``). Required for packed
            batches and under CP; without it every row is one whole sequence and this is plain causal
            attention over the local tokens.
        scale: softmax scale, default ``D ** -0.5`` (Gemma's ``query_pre_attn_scalar ** -0.5``, Granite's
            ``attention_multiplier``); a positive number.
        window: sliding window in tokens, ``transformers``' ``sliding_window``: the query at position ``i``
            of a sequence sees key ``j`` iff ``i - window < j <= i`` (``window=1``: itself only). ``None``:
            full causal attention. Per call, so per layer: models that alternate windowed and global layers
            pass it on the windowed ones. Each piece's keys start at its window
            (``_key_selection.shard_keys``, built once per batch and window).
        softcap: attention logit softcapping (Gemma-2's ``attn_logit_softcapping``), a positive number:
            scores become ``softcap * tanh(scale * q . k / softcap)`` before the mask and the softmax.
        sinks: ``[Hq]`` attention sinks (gpt-oss's ``sinks``, passed as ``s_aux``): one learned logit per
            query head that joins every softmax denominator without a value, so a query may attend to
            "nothing". Differentiable: its gradient is returned like ``q``'s.
        selected: sparse attention (DeepSeek Sparse Attention): ``[B * S_local, n]`` integers, the keys each
            query attends to, as rows in sequence order with ``-1`` for none
            (:func:`~lightning_cp.parallel.key_indexer.select_topk_keys` of this ``cp_shard``, required). Each
            query attends to exactly those keys (:func:`~lightning_cp.parallel.sparse_attention.sparse_attention`,
            computed in fp32 by the exact torch kernel, with the all-gather whatever the attention mode); not
            with ``window`` or ``softcap``.

    Returns:
        ``[B, Hq, S_local, Dv]``: the attention output of this rank's queries, in the compute dtype.

    Kernels: on CUDA GPUs of compute capability 8.0 or newer with fp16 / bf16 inputs and head dims (the
    larger of ``D``, ``Dv``) that are multiples of 8 up to 256, PyTorch's FlashAttention-2 varlen kernels
    (``window`` through their window arguments, ``Dv != D`` through zero padding of the smaller head dim,
    ``sinks`` as a correction through the log-sum-exp). Everywhere else, and on CUDA whenever ``softcap``
    is set (FlashAttention-2 has none), an exact blocked torch kernel that computes in fp32 with one bounded
    block of scores at a time (slower than FlashAttention on CUDA). The choice is logged once per process.
    Rows that are whole sequences on one rank with none of ``window``, ``softcap``, ``sinks`` take the
    fused causal SDPA.

    Communication, over the shard's CP group, by its
    :class:`~lightning_cp.parallel.attention_mode.AttentionMode`: the all-gather, per round of key/value
    heads, gathers K and V in the forward, again in the backward, and reduce-scatters (NCCL) or all-reduces
    (gloo) their gradients, in fp32; with a window the whole K/V are still gathered, only the keys each
    piece reaches are selected. Ulysses: one all-to-all to the heads and one back, each way. None without
    CP.

    Raises:
        ValueError: on inconsistent shapes, a shard of another batch, or a ``scale``, ``window``,
            ``softcap`` or ``sinks`` that is not as described above.
    """
    _check_shapes(q, k, v)
    scale = _check_variants(q, scale, window, softcap, sinks)
    _check_selected(q, selected, cp_shard, window, softcap)
    dtype = compute_dtype(q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    # Autocast would run the blocked kernel's einsums in its dtype in the forward but not in the backward:
    # the inputs are in the compute dtype already, and the kernels choose their own accumulation.
    with torch.autocast(q.device.type, enabled=False) if _autocast_on(q) else contextlib.nullcontext():
        if selected is not None:
            return sparse_attention(q, k, v, selected, cp_shard, scale, sinks)
        return _attention(q, k, v, cp_shard, scale, window, softcap, sinks)


def blocked_kernel_score_bytes() -> int:
    """Bytes of the fp32 ``[heads, block, keys]`` score block the exact blocked kernel (CPU, and CUDA without
    FlashAttention) computes at a time, which bounds its query blocks; its backward holds two. What the memory
    plan counts (``lightning_cp.plan``), read from the kernel."""
    return _varlen.SCORE_BLOCK_BYTES


def compute_dtype(q: Tensor, k: Tensor, v: Tensor) -> torch.dtype:
    """The dtype attention of ``q``, ``k``, ``v`` computes in, what SDPA would: under autocast for their
    device, autocast's dtype (float64 inputs stay float64, as autocast leaves them); else the widest of
    the three (with mixed precision's fp32 rotary tables, q and k arrive fp32 beside a bf16 v)."""
    dtypes = [q.dtype, k.dtype, v.dtype]
    if _autocast_on(q):
        low = torch.get_autocast_dtype(q.device.type)
        dtypes = [d if d == torch.float64 else low for d in dtypes]
    return functools.reduce(torch.promote_types, dtypes)


def _autocast_on(x: Tensor) -> bool:
    return torch.is_autocast_enabled(x.device.type)


def _attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cp_shard: CPShard | None,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """:func:`context_parallel_attention` of checked ``q``, ``k``, ``v`` of one dtype, outside autocast: one
    rank's attention without CP, else the shard's exchange."""
    batch, heads, local_len, _ = q.shape
    if cp_shard is None:
        return local_attention(q, k, v, None, scale, window, softcap, sinks)
    if cp_shard.local_tokens != batch * local_len:
        raise ValueError(
            f"cp_shard describes {cp_shard.local_tokens} local tokens but q holds B * S_local = "
            f"{batch} * {local_len}; pass the shard of the batch these tensors come from."
        )
    cp = cp_shard.split.cp_size
    if cp == 1:
        return local_attention(q, k, v, cp_shard, scale, window, softcap, sinks)
    if cp_shard.attention.ulysses(heads, k.shape[1], cp):
        return ulysses_attention(q, k, v, cp_shard, scale, window, softcap, sinks)
    return allgather_attention(q, k, v, cp_shard, scale, window, softcap, sinks)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            "q must be [B, Hq, S_local, D], k [B, Hkv, S_local, D] and v [B, Hkv, S_local, Dv]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    batch, heads, local_len, dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != batch or k.shape[2] != local_len or k.shape[3] != dim or heads % kv_heads:
        raise ValueError(
            f"k, v {tuple(k.shape)} do not fit q {tuple(q.shape)}: they need the same B and S_local, k "
            f"the same D, and their head count ({kv_heads}) must divide q's ({heads})."
        )
    return batch, heads, local_len


def _check_selected(
    q: Tensor, selected: Tensor | None, cp_shard: CPShard | None, window: int | None, softcap: float | None
) -> None:
    if selected is None:
        return
    tokens = q.shape[0] * q.shape[2]
    if cp_shard is None or cp_shard.local_tokens != tokens:
        raise ValueError(
            "selected keys are rows of the batch's sequences in sequence order: pass the cp_shard they were "
            f"selected for (this rank's {tokens} query tokens)."
        )
    if selected.dim() != 2 or selected.shape[0] != tokens or selected.is_floating_point():
        raise ValueError(
            f"selected must be an integer tensor [B * S_local, n] = [{tokens}, n]; got {tuple(selected.shape)} "
            f"{selected.dtype}."
        )
    if window is not None or softcap is not None:
        raise ValueError("sparse attention (selected keys) takes no window and no softcap.")


def _check_variants(
    q: Tensor, scale: float | None, window: int | None, softcap: float | None, sinks: Tensor | None
) -> float:
    """Validate the variant arguments; return the scale to use."""
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a positive finite number (the default is D ** -0.5).")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"window={window!r} must be a positive integer number of tokens (a query sees itself and the "
            "window - 1 tokens before it), or None for full causal attention."
        )
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(
            f"softcap={softcap!r} must be a positive finite number (scores become "
            "softcap * tanh(score / softcap)), or None for no softcapping."
        )
    if sinks is not None and (
        not isinstance(sinks, Tensor)
        or sinks.shape != (q.shape[1],)
        or not sinks.is_floating_point()
        or sinks.device != q.device
    ):
        described = (
            f"{tuple(sinks.shape)} {sinks.dtype} on {sinks.device}" if isinstance(sinks, Tensor) else sinks
        )
        raise ValueError(
            f"sinks must be a float tensor [Hq] = [{q.shape[1]}] on {q.device}, one logit per query head; "
            f"got {described}."
        )
    return q.shape[-1] ** -0.5 if scale is None else float(scale)
