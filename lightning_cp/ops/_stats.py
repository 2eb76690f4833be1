"""Per-token softmax statistics: a backend's partials, their merge over vocabulary shards, :class:`TokenStats`.

A backend (torch or Triton) reduces each row of a ``[n, V_local]`` chunk of (transformed) logits ``s`` to
a few numbers, relative to the row's local maximum ``m``:

=========  ==================================================================
``MAX``      ``m = max_j s_j``
``SUMEXP``   ``S = sum_j exp(s_j - m)``
``TARGET``   ``s[label]`` if this shard holds the label, else 0
``ARGMAX``   local index of the first maximum, stored as int32 *bits*
``SHIFTED``  ``A = sum_j exp(s_j - m) * (s_j - m)`` (only when entropy is needed)
``SUM``      ``sum_j s_j`` (only when label smoothing is on)
=========  ==================================================================

These are the online-softmax statistics: partials of different vocabulary shards merge exactly after
rescaling to the common maximum, so tensor parallelism needs one all-gather of ``[NUM_STATS, n]``
floats per chunk instead of any gather of logits. Keeping ``A`` relative to the maximum keeps the
entropy ``log S - A / S`` free of the cancellation that ``lse - sum p s`` suffers for large logits.
The argmax travels as int32 bits in the float tensor so that one collective carries everything;
an all-gather copies bytes, so the bits survive.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

MAX, SUMEXP, TARGET, ARGMAX, SHIFTED, SUM = range(6)
NUM_STATS = 6

_NO_INDEX = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class TokenStats:
    """Per-token statistics of the softmax of the (softcapped) logits; all ``[n]``, detached.

    They are byproducts of the loss pass (no extra pass over the vocabulary). The metrics (loss,
    perplexity, accuracy, entropy) read :attr:`nll`, :attr:`correct`, :attr:`entropy` and :attr:`valid`
    and sum them over valid tokens. The same type holds the statistics of one chunk of tokens
    (:func:`merge`) and of the whole input (:meth:`empty`, filled chunk by chunk with :meth:`write`).
    """

    labels: torch.Tensor
    """int64 global vocabulary ids of the targets (``ignore_index`` where ignored)."""
    valid: torch.Tensor
    """bool: the label is not ``ignore_index``."""
    lse: torch.Tensor
    """fp32 ``log sum_j exp(s_j)`` over the full (all-shard) vocabulary."""
    target: torch.Tensor
    """fp32 ``s[label]``; 0 at ignored tokens."""
    argmax: torch.Tensor
    """int64 global vocabulary id of the first maximal logit."""
    entropy: torch.Tensor | None
    """fp32 entropy of the softmax (nats), 0 at ignored tokens; ``None`` when not asked for."""
    total: torch.Tensor | None
    """fp32 ``sum_j s_j`` over the full vocabulary; only kept for label smoothing."""

    @property
    def nll(self) -> torch.Tensor:
        """fp32 ``-log p(label)``, without label smoothing or z-loss; 0 at ignored tokens."""
        return torch.where(self.valid, self.lse - self.target, 0.0)

    @property
    def correct(self) -> torch.Tensor:
        """bool: the first arg-max of the logits is the label; False at ignored tokens."""
        return (self.argmax == self.labels) & self.valid

    @classmethod
    def empty(
        cls, labels: torch.Tensor, valid: torch.Tensor, *, entropy: bool, smoothing: bool
    ) -> TokenStats:
        """Uninitialized statistics for the tokens of ``labels`` ``[N]``, to :meth:`write` chunk by chunk."""

        def vec() -> torch.Tensor:
            return torch.empty(labels.shape, dtype=torch.float32, device=labels.device)

        return cls(
            labels=labels,
            valid=valid,
            lse=vec(),
            target=vec(),
            argmax=torch.empty(labels.shape, dtype=torch.int64, device=labels.device),
            entropy=vec() if entropy else None,
            total=vec() if smoothing else None,
        )

    def write(self, start: int, stop: int, chunk: TokenStats) -> None:
        """Copy the statistics of the chunk of tokens ``[start, stop)``."""
        for name in ("lse", "target", "argmax", "entropy", "total"):
            mine = getattr(self, name)
            if mine is not None:
                mine[start:stop] = getattr(chunk, name)


def merge(
    partial: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    local_vocab: int,
    entropy: bool,
    smoothing: bool,
) -> TokenStats:
    """The :class:`TokenStats` of the ``n`` tokens of ``labels`` / ``valid`` from the ``[NUM_STATS, n]``
    partials of every vocabulary shard of ``group``.

    With a tensor-parallel ``group`` of size ``tp``, rank ``r`` holds vocabulary ids
    ``[r * local_vocab, (r + 1) * local_vocab)``; one all-gather of the partials (``tp * NUM_STATS * n``
    floats) is the only communication. Without a group the same arithmetic runs on one shard.
    ``entropy`` / ``smoothing`` say whether the partials carry ``SHIFTED`` / ``SUM``.
    """
    if group is not None:
        parts = partial.new_empty((dist.get_world_size(group), *partial.shape))
        dist.all_gather(list(parts.unbind(0)), partial.contiguous(), group=group)
    else:
        parts = partial.unsqueeze(0)
    shard_max = parts[:, MAX]
    row_max = shard_max.amax(0)
    shift = shard_max - row_max
    rescale = shift.exp()
    sumexp = (rescale * parts[:, SUMEXP]).sum(0)
    log_sumexp = sumexp.log()
    token_entropy = None
    if entropy:
        shifted = (rescale * (parts[:, SHIFTED] + shift * parts[:, SUMEXP])).sum(0)
        token_entropy = torch.where(valid, log_sumexp - shifted / sumexp, 0.0)

    offsets = torch.arange(parts.shape[0], device=parts.device, dtype=torch.int64).unsqueeze(1) * local_vocab
    local_argmax = parts[:, ARGMAX].view(torch.int32).to(torch.int64)
    candidates = torch.where(shard_max == row_max, local_argmax + offsets, _NO_INDEX)
    return TokenStats(
        labels=labels,
        valid=valid,
        lse=row_max + log_sumexp,
        target=parts[:, TARGET].sum(0),
        argmax=candidates.amin(0),
        entropy=token_entropy,
        total=parts[:, SUM].sum(0) if smoothing else None,
    )
