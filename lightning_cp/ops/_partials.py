"""Softmax partials of a chunk of logits and their merge over vocabulary shards into :class:`TokenStats`.

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

import torch
import torch.distributed as dist

from lightning_cp.ops.token_stats import TokenStats

MAX, SUMEXP, TARGET, ARGMAX, SHIFTED, SUM = range(6)
NUM_STATS = 6

_NO_INDEX = torch.iinfo(torch.int32).max


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
