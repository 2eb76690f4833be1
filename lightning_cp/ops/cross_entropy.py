"""CP-local chunked cross-entropy: the loss of a rank's own tokens without ``[tokens, vocab]`` logits.

At 128K tokens and a 152K vocabulary the logits alone are ~37 GiB in bf16 per rank. Under context
parallelism each rank holds different tokens of the sequence, so the loss needs no communication over
the CP group at all: every rank computes it on its local tokens, chunk by chunk, and only the loss
normalization (elsewhere) sums token counts. Labels arrive already shifted (next token) from the data
pipeline; targets that do not count carry ``ignore_index``.

All three functions share one engine (``_chunked``) with two backends: plain PyTorch and Triton kernels
(``impl="auto"`` takes Triton for CUDA tensors when it is installed). Semantics are those of
``torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=..., reduction=...,
label_smoothing=...)`` on materialized logits, where ``softcap`` first maps ``logits`` to
``softcap * tanh(logits / softcap)`` and ``z_loss`` adds ``z_loss * logsumexp(logits) ** 2`` to the loss
of every valid token. Statistics are accumulated in fp32 whatever the input dtype; gradients come back
in the input dtype. A ``mean`` over zero valid tokens is 0 with zero gradients.

Tensor parallelism (``tp_group``): ``weight`` (or ``logits``) is this rank's vocabulary shard in
Megatron's layout, rank ``r`` of ``tp`` holding global ids ``[r * V / tp, (r + 1) * V / tp)``; labels are
global ids. Each chunk all-gathers ``6 x chunk`` floats of softmax statistics over ``tp_group``; the
returned gradient of ``hidden`` is the full one (all-reduced over ``tp_group`` in the backward), since
``hidden`` is replicated on the TP ranks. Works with gloo and NCCL.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from lightning_cp.ops import _chunked

Reduction = Literal["mean", "sum", "none"]
Impl = Literal["auto", "torch", "triton"]

_REDUCTIONS = ("mean", "sum", "none")
_IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class TokenStats:
    """Per-token byproducts of the loss pass (no extra pass over the vocabulary); all ``[N]``, detached.

    They feed the metrics (loss, perplexity, accuracy, entropy), which sum them over valid tokens.
    """

    nll: torch.Tensor
    """fp32 ``-log p(label)`` of the (softcapped) logits, without smoothing or z-loss; 0 at ignored tokens."""
    correct: torch.Tensor
    """bool: the first arg-max of the logits is the label; False at ignored tokens."""
    entropy: torch.Tensor
    """fp32 entropy of the softmax (nats); 0 at ignored tokens."""
    valid: torch.Tensor
    """bool: the label is not ``ignore_index``."""


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    impl: Impl = "auto",
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, TokenStats]:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels``, fused with the LM head, chunked over tokens.

    Args:
        hidden: ``[N, H]`` final hidden states of this rank's tokens (fp32 / bf16 / fp16). Flatten
            ``[B, S, H]`` first.
        weight: ``[V, H]`` output embedding, same dtype and device as ``hidden``; under ``tp_group``
            this rank's ``[V / tp, H]`` vocabulary shard.
        labels: ``[N]`` integer global vocabulary ids in ``[0, V)``, or ``ignore_index``.
        ignore_index: label value of tokens that do not count.
        reduction: ``"mean"`` (over valid tokens), ``"sum"`` or ``"none"`` (``[N]``, 0 at ignored tokens).
        label_smoothing: in ``[0, 1]``, as in ``torch.nn.functional.cross_entropy``.
        z_loss: coefficient of ``logsumexp(logits) ** 2`` added per valid token.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` before everything else.
        chunk_size: tokens per chunk; default makes one fp32 ``[chunk, V_local]`` block ~512 MiB.
            Larger chunks feed the matmuls better, smaller ones lower the peak memory.
        tp_group: tensor-parallel group over which the vocabulary is sharded (see module docstring).
        impl: ``"auto"``, ``"torch"`` or ``"triton"``.
        return_stats: also return :class:`TokenStats`.

    Returns:
        The fp32 loss (a scalar, or ``[N]`` for ``reduction="none"``), and the :class:`TokenStats` when
        ``return_stats``.

    Memory and work: the extra peak is ``O(chunk x V_local)`` plus the gradient buffers. For a scalar
    loss with gradients needed, the gradients of ``hidden`` and ``weight`` are computed during this call
    (3 matmuls per chunk) and only scaled by the backward; with ``reduction="none"`` the backward
    recomputes the chunk logits.

    Raises:
        ValueError / TypeError: on shape, dtype or option errors, and on CPU for labels outside
            ``[0, V)`` other than ``ignore_index``. On CUDA that check is a device-side assert (no host sync).
    """
    _check_head(hidden, weight)
    opts = _ce_options(reduction, label_smoothing, z_loss)
    plan = _plan(hidden.shape[0], weight.shape[0], hidden.device, impl, chunk_size, softcap, 1.0, tp_group)
    local_labels, valid = _localize_labels(labels, hidden.shape[0], ignore_index, plan, hidden.device)
    need_hidden, need_weight = _needs_grad(hidden), _needs_grad(weight)
    loss, rows = _chunked.LinearCrossEntropy.apply(
        hidden, weight, local_labels, valid, plan, opts, need_hidden, need_weight, return_stats
    )
    return (loss, _token_stats(rows, labels, valid)) if return_stats else loss


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    impl: Impl = "auto",
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, TokenStats]:
    """Cross-entropy of already materialized ``logits`` ``[N, V]``, upcast to fp32 one chunk at a time.

    Same options and results as :func:`linear_cross_entropy`; under ``tp_group`` the logits are this
    rank's ``[N, V / tp]`` vocabulary shard. Unlike ``F.cross_entropy(logits.float(), ...)``, it never
    holds an fp32 copy (or an fp32 ``log_softmax``) of all the logits: the forward saves only the
    per-token ``logsumexp`` and the backward writes into one ``[N, V_local]`` gradient buffer of the
    logits' dtype, chunk by chunk.
    """
    _check_float_matrix("logits", logits)
    opts = _ce_options(reduction, label_smoothing, z_loss)
    plan = _plan(logits.shape[0], logits.shape[1], logits.device, impl, chunk_size, softcap, 1.0, tp_group)
    local_labels, valid = _localize_labels(labels, logits.shape[0], ignore_index, plan, logits.device)
    loss, rows = _chunked.LogitsCrossEntropy.apply(logits, local_labels, valid, plan, opts, return_stats)
    return (loss, _token_stats(rows, labels, valid)) if return_stats else loss


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    softcap: float | None = None,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    impl: Impl = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log p(label)`` under ``softmax(softcap(hidden @ weight.T) / temperature)``, for RL losses.

    ``hidden``, ``weight``, ``labels``, ``ignore_index``, ``softcap``, ``chunk_size``, ``tp_group`` and
    ``impl`` are as in :func:`linear_cross_entropy`.

    Returns:
        ``logprobs`` ``[N]`` fp32, 0 at ignored tokens, differentiable w.r.t. ``hidden`` and ``weight``;
        with ``return_entropy``, also the softmax entropy ``[N]`` fp32 (0 at ignored tokens),
        differentiable too (e.g. for an entropy bonus). The backward takes any per-token upstream
        gradients and recomputes the chunk logits (3 matmuls per chunk).
    """
    _check_head(hidden, weight)
    if not temperature > 0:
        raise ValueError(f"`temperature` must be > 0, got {temperature}.")
    plan = _plan(
        hidden.shape[0],
        weight.shape[0],
        hidden.device,
        impl,
        chunk_size,
        softcap,
        1.0 / temperature,
        tp_group,
    )
    local_labels, valid = _localize_labels(labels, hidden.shape[0], ignore_index, plan, hidden.device)
    logprobs, entropy = _chunked.LinearLogprobs.apply(
        hidden, weight, local_labels, valid, plan, _needs_grad(hidden), _needs_grad(weight), return_entropy
    )
    return (logprobs, entropy) if return_entropy else logprobs


def _needs_grad(t: torch.Tensor) -> bool:
    # Decided out here: inside autograd.Function.forward grad mode is always off.
    return torch.is_grad_enabled() and t.requires_grad


def _token_stats(rows: _chunked.TokenRows, labels: torch.Tensor, valid: torch.Tensor) -> TokenStats:
    return TokenStats(
        nll=torch.where(valid, rows.lse - rows.target, 0.0),
        correct=(rows.argmax == labels) & valid,
        entropy=torch.where(valid, rows.entropy, 0.0),
        valid=valid,
    )


def _check_float_matrix(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}.")
    if t.dim() != 2:
        shape = "[N, H]" if name == "hidden" else "[V, H]" if name == "weight" else "[N, V]"
        raise ValueError(
            f"`{name}` must be 2-D {shape}, got shape {tuple(t.shape)}; "
            "flatten the batch and sequence dimensions."
        )
    if not t.is_floating_point():
        raise TypeError(f"`{name}` must be a floating-point tensor, got dtype {t.dtype}.")


def _check_head(hidden: torch.Tensor, weight: torch.Tensor) -> None:
    _check_float_matrix("hidden", hidden)
    _check_float_matrix("weight", weight)
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"`hidden` is {tuple(hidden.shape)} and `weight` is {tuple(weight.shape)}: their last (hidden) "
            "dimensions must match; `weight` is the [V, H] output embedding, not its transpose."
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"`weight` is {weight.dtype} on {weight.device} but `hidden` is {hidden.dtype} on "
            f"{hidden.device}; cast them to one dtype and device (the matmul runs in the input dtype)."
        )


def _ce_options(reduction: str, label_smoothing: float, z_loss: float) -> _chunked.CEOptions:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {_REDUCTIONS}, got {reduction!r}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"`label_smoothing` must be in [0, 1], got {label_smoothing}.")
    if not z_loss >= 0.0:
        raise ValueError(f"`z_loss` must be >= 0, got {z_loss}.")
    return _chunked.CEOptions(
        reduction=reduction, label_smoothing=float(label_smoothing), z_loss=float(z_loss)
    )


def _plan(
    n_tokens: int,
    local_vocab: int,
    device: torch.device,
    impl: str,
    chunk_size: int | None,
    softcap: float | None,
    inv_temp: float,
    tp_group: dist.ProcessGroup | None,
) -> _chunked.Plan:
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(
            f"`chunk_size` must be a positive int (tokens per chunk) or None (automatic), got {chunk_size!r}."
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"`softcap` must be > 0 or None (no cap), got {softcap}.")
    group, tp = tp_group, 1
    if tp_group is not None:
        tp = dist.get_world_size(tp_group)
        if tp == 1:
            group = None
    return _chunked.Plan(
        impl=_resolve_impl(impl, device),
        chunk_size=chunk_size or _chunked.auto_chunk_size(n_tokens, local_vocab),
        softcap=None if softcap is None else float(softcap),
        inv_temp=float(inv_temp),
        group=group,
        local_vocab=local_vocab,
        vocab=local_vocab * tp,
    )


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"`impl` must be one of {_IMPLS}, got {impl!r}.")
    if impl == "auto":
        return "triton" if device.type == "cuda" and _triton_installed() else "torch"
    if impl == "triton":
        if not _triton_installed():
            raise ImportError(
                "impl='triton' needs the `triton` package: `pip install lightning-cp[triton]`, "
                "or use impl='torch'."
            )
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"impl='triton' runs on CUDA tensors, got tensors on {device}; use impl='torch', or set "
                "TRITON_INTERPRET=1 before the first Triton call to run the kernels in Triton's interpreter."
            )
    return impl


def _localize_labels(
    labels: torch.Tensor, n_tokens: int, ignore_index: int, plan: _chunked.Plan, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local_labels, valid)``: the labels' indices in this vocabulary shard (int64, -1 where ignored or
    on another shard) and ``labels != ignore_index``.

    Labels out of ``[0, V)`` raise on CPU; on other devices a device-side assert fires instead, so that
    the hot path has no host synchronization and bad labels still never produce a silent garbage loss.
    """
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"`labels` must be a torch.Tensor, got {type(labels).__name__}.")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"`labels` must hold integer vocabulary ids, got dtype {labels.dtype}; use .long().")
    if labels.shape != (n_tokens,):
        raise ValueError(
            f"`labels` must have shape ({n_tokens},), one per token of the input, got {tuple(labels.shape)}; "
            "flatten [B, S] labels the same way as the input."
        )
    if labels.device != device:
        raise ValueError(
            f"`labels` is on {labels.device} but the input is on {device}; move them to one device."
        )
    labels = labels.long()
    valid = labels != ignore_index
    in_range = ((labels >= 0) & (labels < plan.vocab)) | ~valid
    message = f"`labels` must be in [0, {plan.vocab}) or equal ignore_index={ignore_index}"
    if device.type == "cpu":
        if not bool(in_range.all()):
            bad = labels[~in_range][0].item()
            raise ValueError(
                f"{message}, got {bad}. Check the tokenizer's vocabulary size against the weight's."
            )
    else:
        torch._assert_async(in_range.all(), message)
    start = plan.local_vocab * (dist.get_rank(plan.group) if plan.group is not None else 0)
    local = labels - start
    owned = valid & (local >= 0) & (local < plan.local_vocab)
    return torch.where(owned, local, -1), valid
