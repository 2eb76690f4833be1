"""Per-token softmax statistics of one chunk of logits, and their merge over vocabulary shards.

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


@dataclass
class ChunkStats:
    """Statistics of the full (all-shard) softmax for the rows of one chunk; all ``[n]``.

    ``entropy`` is only meaningful when the partials carried ``SHIFTED``, ``total`` only when they
    carried ``SUM``.
    """

    lse: torch.Tensor
    """fp32 ``log sum_j exp(s_j)``."""
    target: torch.Tensor
    """fp32 ``s[label]``; 0 where the label is ignored."""
    argmax: torch.Tensor
    """int64 global vocabulary id of the first maximum."""
    entropy: torch.Tensor
    """fp32 entropy of ``softmax(s)``."""
    total: torch.Tensor
    """fp32 ``sum_j s_j`` over the full vocabulary."""


def merge(partial: torch.Tensor, group: dist.ProcessGroup | None, local_vocab: int) -> ChunkStats:
    """Merge the ``[NUM_STATS, n]`` partials of every vocabulary shard of ``group`` into :class:`ChunkStats`.

    With a tensor-parallel ``group`` of size ``tp``, rank ``r`` holds vocabulary ids
    ``[r * local_vocab, (r + 1) * local_vocab)``; one all-gather of the partials (``tp * NUM_STATS * n``
    floats) is the only communication. Without a group the same arithmetic runs on one shard.
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
    shifted = (rescale * (parts[:, SHIFTED] + shift * parts[:, SUMEXP])).sum(0)
    log_sumexp = sumexp.log()

    offsets = torch.arange(parts.shape[0], device=parts.device, dtype=torch.int64).unsqueeze(1) * local_vocab
    local_argmax = parts[:, ARGMAX].view(torch.int32).to(torch.int64)
    candidates = torch.where(shard_max == row_max, local_argmax + offsets, _NO_INDEX)
    return ChunkStats(
        lse=row_max + log_sumexp,
        target=parts[:, TARGET].sum(0),
        argmax=candidates.amin(0),
        entropy=log_sumexp - shifted / sumexp,
        total=parts[:, SUM].sum(0),
    )
