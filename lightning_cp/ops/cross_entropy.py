"""CP-local chunked cross-entropy: the loss of a rank's own tokens without ``[tokens, vocab]`` logits.

At 128K tokens and a 152K vocabulary the logits alone are ~37 GiB in bf16 per rank. Under context
parallelism each rank holds different tokens of the sequence, so the loss needs no communication over
the CP group at all: every rank computes it on its local tokens, chunk by chunk, and only the loss
normalization (elsewhere) sums token counts. Labels arrive already shifted (next token) from the data
pipeline; targets that do not count carry ``ignore_index``.

Each loss comes as two functions: one returns the loss, its ``_with_stats`` twin also the per-token
:class:`~lightning_cp.ops.TokenStats` that the metrics read (``token_logprobs`` likewise has
``token_logprobs_with_entropy``). All share one engine (``_engine``) with two backends: plain PyTorch
and Triton kernels (``impl="auto"`` takes Triton for CUDA tensors when it is installed). Semantics are those of
``torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=..., reduction=...,
label_smoothing=...)`` on materialized logits ``softcap(logit_scale * (hidden @ weight.T + bias))``: the
LM head's optional ``bias``, a ``logit_scale`` multiplier (Cohere's ``logit_scale``; Granite divides by
``logits_scaling``, i.e. ``logit_scale=1 / logits_scaling``) and ``softcap`` mapping ``x`` to
``softcap * tanh(x / softcap)`` (Gemma-2's ``final_logit_softcapping``); ``z_loss`` adds
``z_loss * logsumexp(logits) ** 2`` to the loss of every valid token. Statistics are accumulated in fp32 whatever the input dtype; gradients come back
in the input dtype (a bf16 / fp16 weight's gradient is summed over the tokens in fp32 and rounded
once). Under autocast (``bf16-mixed`` with DDP: fp32 hidden states and weight) every matmul, the gradients'
too, runs in autocast's dtype, as autocast runs ``F.linear``: the head cast once per pass, an fp32 weight's
gradient summed in fp32. A ``mean`` over zero valid tokens is 0 with zero gradients.

Tensor parallelism (``tp_group``): ``weight`` and ``bias`` (or ``logits``) are this rank's vocabulary shard in
Megatron's layout, rank ``r`` of ``tp`` holding global ids ``[r * V / tp, (r + 1) * V / tp)``; labels are
global ids. Each chunk all-gathers ``6 x chunk`` floats of softmax statistics over ``tp_group``; the
returned gradient of ``hidden`` is the full one (all-reduced over ``tp_group`` in the backward), since
``hidden`` is replicated on the TP ranks. Works with gloo and NCCL.
"""

from __future__ import annotations

from typing import Literal, TypedDict

import torch
import torch.distributed as dist
from typing_extensions import Unpack

from lightning_cp.ops._formulas import CEOptions
from lightning_cp.ops._linear_cross_entropy import LinearCrossEntropy
from lightning_cp.ops._logits_cross_entropy import LogitsCrossEntropy
from lightning_cp.ops._plan import Plan
from lightning_cp.ops._token_logprobs import LinearLogprobs
from lightning_cp.ops.token_stats import TokenStats

Reduction = Literal["mean", "sum", "none"]
Impl = Literal["auto", "torch", "triton"]


class HeadOptions(TypedDict, total=False):
    """Keyword options of every function here; all optional, defaults in brackets."""

    ignore_index: int
    """Label value of tokens that do not count [``-100``]."""
    logit_scale: float
    """Positive multiplier of the logits, before the cap (a divisor ``d`` is ``1 / d``) [``1.0``]."""
    softcap: float | None
    """If set, logits become ``softcap * tanh(logits / softcap)`` (after ``logit_scale``) [``None``]."""
    chunk_size: int | None
    """Tokens per chunk [``None``: one fp32 ``[chunk, V_local]`` block of 256 MiB on CPU; on CUDA sized from
    the free memory (``lightning_cp.ops._plan.auto_chunk_size``), 512 MiB with ``tp_group``].
    Larger chunks feed the matmuls better, smaller ones lower the peak memory."""
    tp_group: dist.ProcessGroup | None
    """Tensor-parallel group over which the vocabulary is sharded (see the module docstring) [``None``]."""
    impl: Impl
    """``"auto"`` (Triton for CUDA tensors when installed, else torch), ``"torch"`` or ``"triton"`` [``"auto"``]."""


class LossOptions(HeadOptions, total=False):
    """Keyword options of the cross-entropy functions: :class:`HeadOptions` and these."""

    reduction: Reduction
    """``"mean"`` (over valid tokens), ``"sum"`` or ``"none"`` (``[N]``, 0 at ignored tokens) [``"mean"``]."""
    label_smoothing: float
    """In ``[0, 1]``, as in ``torch.nn.functional.cross_entropy`` [``0.0``]."""
    z_loss: float
    """Coefficient of ``logsumexp(logits) ** 2`` added per valid token [``0.0``]."""


class LogprobOptions(HeadOptions, total=False):
    """Keyword options of the log-probability functions: :class:`HeadOptions` and this."""

    temperature: float
    """The softmax is that of ``softcap(logit_scale * logits) / temperature`` [``1.0``]."""


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    **options: Unpack[LossOptions],
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, fused with the LM head, chunked over
    tokens.

    Args:
        hidden: ``[N, H]`` final hidden states of this rank's tokens (fp32 / bf16 / fp16). Flatten
            ``[B, S, H]`` first.
        weight: ``[V, H]`` output embedding, same dtype and device as ``hidden``; under ``tp_group``
            this rank's ``[V / tp, H]`` vocabulary shard.
        labels: ``[N]`` integer global vocabulary ids in ``[0, V)``, or ``ignore_index``.
        bias: ``[V]`` LM-head bias (Phi's ``lm_head.bias``), same dtype and device as ``weight``; under
            ``tp_group`` this rank's ``[V / tp]`` shard. Its gradient is summed over the tokens in fp32.
        **options: :class:`LossOptions` (``ignore_index``, ``reduction``, ``label_smoothing``, ``z_loss``,
            ``logit_scale``, ``softcap``, ``chunk_size``, ``tp_group``, ``impl``).

    Returns:
        The fp32 loss: a scalar, or ``[N]`` for ``reduction="none"``.

    Memory and work: the extra peak is ``O(chunk x V_local)`` plus the gradient buffers. For a scalar
    loss with gradients needed, the gradients of ``hidden`` and ``weight`` are computed during this call
    (3 matmuls per chunk) and only scaled by the backward; with ``reduction="none"`` the backward
    recomputes the chunk logits. A bf16 / fp16 ``weight`` gets its gradient from a second pass over
    vocabulary blocks (2 more matmuls per chunk, at most 2 x 256 MiB of fp32 accumulators) instead of
    an fp32 ``[V, H]`` buffer. Communication: none without ``tp_group`` (see the module docstring).

    Raises:
        ValueError / TypeError: on shape, dtype or option errors (an unknown keyword too), and on CPU for
            labels outside ``[0, V)`` other than ``ignore_index``. On CUDA that check is a device-side
            assert (no host sync).
    """
    loss, _ = _cross_entropy(hidden, (weight, bias), labels, entropy=False, **options)
    return loss


def linear_cross_entropy_with_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    **options: Unpack[LossOptions],
) -> tuple[torch.Tensor, TokenStats]:
    """:func:`linear_cross_entropy` and the :class:`TokenStats` of the ``N`` tokens, entropy included.

    The statistics come from the same pass over the vocabulary (the entropy adds one reduction per
    chunk), detached; arguments, loss, errors and communication are those of :func:`linear_cross_entropy`.
    """
    return _cross_entropy(hidden, (weight, bias), labels, entropy=True, **options)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, **options: Unpack[LossOptions]) -> torch.Tensor:
    """Cross-entropy of already materialized ``logits`` ``[N, V]``, upcast to fp32 one chunk at a time.

    Same options and results as :func:`linear_cross_entropy`; under ``tp_group`` the logits are this
    rank's ``[N, V / tp]`` vocabulary shard. Unlike ``F.cross_entropy(logits.float(), ...)``, it never
    holds an fp32 copy (or an fp32 ``log_softmax``) of all the logits: the forward saves only the
    per-token ``logsumexp`` and the backward writes into one ``[N, V_local]`` gradient buffer of the
    logits' dtype, chunk by chunk.
    """
    loss, _ = _cross_entropy(logits, None, labels, entropy=False, **options)
    return loss


def cross_entropy_with_stats(
    logits: torch.Tensor, labels: torch.Tensor, **options: Unpack[LossOptions]
) -> tuple[torch.Tensor, TokenStats]:
    """:func:`cross_entropy` and the :class:`TokenStats` of the ``N`` tokens, entropy included (as
    :func:`linear_cross_entropy_with_stats`)."""
    return _cross_entropy(logits, None, labels, entropy=True, **options)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    **options: Unpack[LogprobOptions],
) -> torch.Tensor:
    """Per-token ``log p(label)`` under ``softmax(softcap(logit_scale * (hidden @ weight.T + bias)) /
    temperature)``, for RL losses.

    ``hidden``, ``weight``, ``labels`` and ``bias`` are as in :func:`linear_cross_entropy`; ``**options``
    are :class:`LogprobOptions` (``temperature``, ``ignore_index``, ``logit_scale``, ``softcap``,
    ``chunk_size``, ``tp_group``, ``impl``).

    Returns:
        ``logprobs`` ``[N]`` fp32, 0 at ignored tokens, differentiable w.r.t. ``hidden``, ``weight`` and
        ``bias``.
        The backward takes any per-token upstream gradients and recomputes the chunk logits (3 matmuls
        per chunk; 2 more for a bf16 / fp16 ``weight``, see :func:`linear_cross_entropy`).
    """
    logprobs, _ = _token_logprobs(hidden, (weight, bias), labels, entropy=False, **options)
    return logprobs


def token_logprobs_with_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    **options: Unpack[LogprobOptions],
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` and the softmax entropy ``[N]`` fp32 (nats, 0 at ignored tokens), both
    differentiable (e.g. for an entropy bonus); from the same pass over the vocabulary."""
    logprobs, entropy = _token_logprobs(hidden, (weight, bias), labels, entropy=True, **options)
    assert entropy is not None, "entropy=True fills it"
    return logprobs, entropy


def _cross_entropy(
    inputs: torch.Tensor,
    head: tuple[torch.Tensor, torch.Tensor | None] | None,
    labels: torch.Tensor,
    *,
    entropy: bool,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, TokenStats]:
    """The loss and statistics of ``hidden`` ``[N, H]`` through ``head = (weight, bias)``, or of ``logits``
    ``[N, V_local]`` when ``head`` is ``None``; the keywords (defaults included) of :class:`LossOptions`."""
    if head is None:
        _check_float_matrix("logits", inputs)
    else:
        _check_head(inputs, *head)
    opts = CEOptions.build(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss)
    plan = Plan.build(
        n_tokens=inputs.shape[0],
        local_vocab=inputs.shape[1] if head is None else head[0].shape[0],
        device=inputs.device,
        impl=impl,
        chunk_size=chunk_size,
        logit_scale=logit_scale,
        softcap=softcap,
        tp_group=tp_group,
        input_dtype=None if head is None else inputs.dtype,
    )
    local_labels, stats = _prepare_targets(
        labels, ignore_index, plan, inputs, entropy=entropy, smoothing=opts.label_smoothing > 0
    )
    if head is None:
        return LogitsCrossEntropy.apply(inputs, local_labels, stats, plan, opts), stats
    weight, bias = head
    loss = LinearCrossEntropy.apply(
        inputs, weight, bias, local_labels, stats, plan, opts, _needs_grads(inputs, weight, bias)
    )
    return loss, stats


def _token_logprobs(
    hidden: torch.Tensor,
    head: tuple[torch.Tensor, torch.Tensor | None],
    labels: torch.Tensor,
    *,
    entropy: bool,
    temperature: float = 1.0,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities and (with ``entropy``) the entropy; the keywords of :class:`LogprobOptions`."""
    weight, bias = head
    _check_head(hidden, weight, bias)
    plan = Plan.build(
        n_tokens=hidden.shape[0],
        local_vocab=weight.shape[0],
        device=hidden.device,
        impl=impl,
        chunk_size=chunk_size,
        logit_scale=logit_scale,
        softcap=softcap,
        tp_group=tp_group,
        temperature=temperature,
        input_dtype=hidden.dtype,
    )
    local_labels, stats = _prepare_targets(
        labels, ignore_index, plan, hidden, entropy=entropy, smoothing=False
    )
    return LinearLogprobs.apply(
        hidden, weight, bias, local_labels, stats, plan, _needs_grads(hidden, weight, bias)
    )


def _needs_grads(*tensors: torch.Tensor | None) -> tuple[bool, ...]:
    # Decided out here: inside autograd.Function.forward grad mode is always off.
    enabled = torch.is_grad_enabled()
    return tuple(enabled and t is not None and t.requires_grad for t in tensors)


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


def _check_head(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
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
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"`bias` must be a torch.Tensor or None, got {type(bias).__name__}.")
    if bias.shape != weight.shape[:1]:
        raise ValueError(
            f"`bias` must have shape ({weight.shape[0]},), one entry per row of `weight`, got "
            f"{tuple(bias.shape)}."
        )
    if bias.dtype != weight.dtype or bias.device != weight.device:
        raise ValueError(
            f"`bias` is {bias.dtype} on {bias.device} but `weight` is {weight.dtype} on {weight.device}; "
            "cast the head's bias like its weight."
        )


def _prepare_targets(
    labels: torch.Tensor,
    ignore_index: int,
    plan: Plan,
    inputs: torch.Tensor,
    *,
    entropy: bool,
    smoothing: bool,
) -> tuple[torch.Tensor, TokenStats]:
    """Check ``labels`` against the ``[N, ...]`` ``inputs``; return their indices in this vocabulary shard
    (int64, -1 where ignored or on another shard) and the empty :class:`TokenStats` of the N tokens.

    Labels out of ``[0, V)`` raise on CPU; on other devices a device-side assert fires instead, so that
    the hot path has no host synchronization and bad labels still never produce a silent garbage loss.
    """
    n_tokens, device = inputs.shape[0], inputs.device
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
    local = labels - plan.shard_start
    owned = valid & (local >= 0) & (local < plan.local_vocab)
    stats = TokenStats.empty(labels, valid, entropy=entropy, smoothing=smoothing)
    return torch.where(owned, local, -1), stats
