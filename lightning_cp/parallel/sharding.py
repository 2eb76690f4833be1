"""Shift-then-split of batches along the sequence for context parallelism, and the inverse.

``shard_batch`` runs on every rank on the *full* sequence, before any model code (DESIGN.md, flow
step 2):

1. labels become the next token (within each packed sequence; the last token of a sequence has none),
   ``loss_mask`` is rolled the same way, ``position_ids`` are taken from the full sequence;
2. every sequence is padded to a multiple of ``2 * cp`` (padding is never a target) and cut into
   ``2 * cp`` equal chunks; CP rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r``.

The kept chunks balance the causal-attention work over ranks (an early chunk is cheap, a late one
expensive). For padded ``[B, S]`` batches the layout is identical to Megatron-core's
``get_batch_on_this_cp_rank``; for packed ``[1, T]`` batches every sequence is split on its own, as
TransformerEngine's THD layout does, so each rank holds two pieces of every sequence.

All index arithmetic is vectorized over sequences (``_split_index``); the same function is used by
the attention to recover each local token's position in its sequence, so the split lives in one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_cp.constants import IGNORE_INDEX

_PACKED_KEYS = ("cu_seqlens", "cu_seqlens_padded")
_DERIVED_KEYS = ("labels", "loss_mask", "input_mask", "position_ids")


def _split_index(lengths: Tensor, cp_size: int, cp_rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """Which tokens of each sequence CP rank ``cp_rank`` keeps, in its local order.

    Args:
        lengths: ``[n]`` int64, the unpadded length of each sequence.

    Returns:
        ``(sequence, offset, local_lengths)``: for each local token, the index of its sequence ``[T_local]``
        and its position inside that sequence after padding ``[T_local]`` (``offset >= length`` marks
        padding); and the number of local tokens of each sequence ``[n]`` (``2 * ceil(length / (2 * cp))``).
    """
    chunk = torch.div(lengths + 2 * cp_size - 1, 2 * cp_size, rounding_mode="floor")
    local_lengths = 2 * chunk
    total = int(local_lengths.sum())
    sequence = torch.repeat_interleave(
        torch.arange(len(lengths), device=lengths.device), local_lengths, output_size=total
    )
    starts = torch.cumsum(local_lengths, 0) - local_lengths
    j = torch.arange(total, device=lengths.device) - starts[sequence]
    c = chunk[sequence]
    second = j >= c
    offset = torch.where(second, (2 * cp_size - 1 - cp_rank) * c + (j - c), cp_rank * c + j)
    return sequence, offset, local_lengths


def _check_cp(cp_size: int, cp_rank: int) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an integer >= 1, got {cp_size!r}.")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an integer in [0, {cp_size}), got {cp_rank!r}.")


def _check_cu_seqlens(cu_seqlens: Any, total: int) -> Tensor:
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point():
        raise ValueError(
            f"batch['cu_seqlens'] must be a 1-D integer tensor [num_sequences + 1], got {cu_seqlens!r}."
        )
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(
            "batch['cu_seqlens'] must start at 0, increase strictly and end at the number of packed tokens "
            f"input_ids.shape[1]={total}; got {cu.tolist()}. Build it as [0, len_0, len_0 + len_1, ...]."
        )
    return cu


def _shift_targets(
    input_ids: Tensor, batch: Mapping[str, Any], last: Tensor, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """Next-token labels and their loss mask, on the full ``[B, S]`` (or packed ``[1, T]``) sequence.

    ``last`` is a boolean ``[B, S]`` marking the last token of every sequence: it predicts nothing.
    """
    labels = batch.get("labels", input_ids)
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"batch['labels'] has shape {tuple(labels.shape)}, expected input_ids' {tuple(input_ids.shape)}."
        )
    target = labels != ignore_index
    if "loss_mask" in batch:
        loss_mask = batch["loss_mask"]
        if loss_mask.shape != input_ids.shape:
            raise ValueError(
                f"batch['loss_mask'] has shape {tuple(loss_mask.shape)}, expected input_ids' {tuple(input_ids.shape)}."
            )
        target = target & loss_mask.bool()
    next_target = torch.roll(target, -1, dims=1) & ~last
    next_labels = torch.where(next_target, torch.roll(labels, -1, dims=1), ignore_index)
    return next_labels, next_target


def _gather_tokens(value: Tensor, src: Tensor, valid: Tensor, fill: float | int) -> Tensor:
    """``value[:, src]`` along dim 1, with ``fill`` where ``valid`` is False (padding)."""
    picked = value.index_select(1, src.clamp(max=value.shape[1] - 1))
    mask = valid.view(1, -1, *([1] * (value.dim() - 2)))
    return torch.where(mask, picked, torch.as_tensor(fill, dtype=value.dtype, device=value.device))


def shard_batch(
    batch: Mapping[str, Any], cp_size: int, cp_rank: int, *, ignore_index: int = IGNORE_INDEX, pad_id: int = 0
) -> dict[str, Any]:
    """Shift labels to the next token, pad and keep this CP rank's two chunks of every sequence.

    Runs locally (no communication); every CP peer calls it on the same full batch.

    Args:
        batch: ``input_ids`` ``[B, S]`` (padded) or ``[1, T]`` with ``cu_seqlens`` ``[n + 1]`` (packed).
            Optional ``labels`` (aligned with ``input_ids``, as in Hugging Face: *not* shifted; defaults to
            ``input_ids``), ``loss_mask`` (aligned with ``input_ids``: 1 where the token is a target) and
            ``position_ids``, and ``input_mask`` (1 on real tokens, 0 on collate padding). Every other tensor
            whose first two dims are those of ``input_ids`` is split
            the same way (padded with zeros); anything else passes through unchanged.
        cp_size: number of ranks in the context-parallel group.
        cp_rank: this rank's index in it.
        ignore_index: label of positions that are not targets.
        pad_id: token id used to pad sequences to a multiple of ``2 * cp_size``.

    Returns:
        A new dict with this rank's tokens: ``input_ids``, ``labels`` (next token, ``ignore_index`` where
        not a target), ``loss_mask`` (float32, 1 on targets), ``position_ids`` (position inside the
        sequence, int64), ``input_mask`` (bool, False on padding, including the padding added here, so
        token counts need no knowledge of the layout), the other sequence tensors, and for packed batches
        ``cu_seqlens`` (this rank's local boundaries, int32) and ``cu_seqlens_padded`` (boundaries of the
        padded full sequence, int32).
        Local length is ``S_pad / cp`` (padded) or ``sum(len_pad_i) / cp`` (packed).

    Raises:
        ValueError: no ``input_ids``, wrong shapes or dtypes, or ``cu_seqlens`` that do not cover the tokens.
    """
    _check_cp(cp_size, cp_rank)
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        keys = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"A context-parallel batch must be a dict with 'input_ids' [B, S] (or [1, T] with 'cu_seqlens'); got {keys}."
        )
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"batch['input_ids'] must be a 2-D integer tensor [B, S], got {input_ids!r}.")
    rows, seq_len = input_ids.shape
    device = input_ids.device
    packed = batch.get("cu_seqlens") is not None

    if packed:
        if rows != 1:
            raise ValueError(
                f"A packed batch (with 'cu_seqlens') must have input_ids of shape [1, T], got {tuple(input_ids.shape)}."
            )
        cu = _check_cu_seqlens(batch["cu_seqlens"], seq_len).to(device)
        lengths = cu[1:] - cu[:-1]
        starts = cu[:-1]
    else:
        lengths = torch.tensor([seq_len], device=device)
        starts = torch.zeros(1, dtype=torch.int64, device=device)

    last = torch.zeros_like(input_ids, dtype=torch.bool)
    last[0 if packed else slice(None), (starts + lengths - 1)] = True
    labels, target = _shift_targets(input_ids, batch, last, ignore_index)

    sequence, offset, local_lengths = _split_index(lengths, cp_size, cp_rank)
    valid = offset < lengths[sequence]
    src = starts[sequence] + offset

    if "position_ids" in batch:
        position_ids = torch.where(valid, _gather_tokens(batch["position_ids"], src, valid, 0), offset)
    else:
        position_ids = offset.unsqueeze(0).expand(rows, -1)

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _PACKED_KEYS or key in _DERIVED_KEYS:
            continue
        if isinstance(value, Tensor) and value.shape[:2] == input_ids.shape:
            value = _gather_tokens(value, src, valid, pad_id if key == "input_ids" else 0)
        out[key] = value
    input_mask = batch.get("input_mask", torch.ones_like(input_ids, dtype=torch.bool))
    out["input_mask"] = _gather_tokens(input_mask.bool(), src, valid, False)
    out["labels"] = _gather_tokens(labels, src, valid, ignore_index)
    out["loss_mask"] = _gather_tokens(target, src, valid, False).float()
    out["position_ids"] = position_ids.to(torch.int64).contiguous()
    if packed:
        padded_lengths = local_lengths * cp_size
        out["cu_seqlens"] = _cumulative(local_lengths)
        out["cu_seqlens_padded"] = _cumulative(padded_lengths)
    return out


def _cumulative(lengths: Tensor) -> Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def unshard(
    shards: Sequence[Tensor], *, seq_len: int | None = None, cu_seqlens: Tensor | None = None
) -> Tensor:
    """Reassemble the full sequence from every CP rank's shard (the inverse of :func:`shard_batch`'s split).

    Local: the caller brings the shards (e.g. from an all-gather over the CP group).

    Args:
        shards: one tensor per CP rank, in CP-rank order, each ``[B, S_local, ...]``.
        seq_len: the unpadded length ``S`` of a padded batch; the padding added by ``shard_batch`` is dropped.
        cu_seqlens: for packed batches, the original (unpadded) ``cu_seqlens`` ``[n + 1]``.

    Returns:
        ``[B, S, ...]`` (padded) or ``[1, T, ...]`` (packed) in the original token order.
    """
    cp_size = len(shards)
    rows, local_len = shards[0].shape[:2]
    device = shards[0].device
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        lengths, starts, total = cu[1:] - cu[:-1], cu[:-1], int(cu[-1])
    else:
        total = seq_len if seq_len is not None else local_len * cp_size
        lengths = torch.tensor([total], device=device)
        starts = torch.zeros(1, dtype=torch.int64, device=device)
    out = shards[0].new_zeros((rows, total, *shards[0].shape[2:]))
    for rank, shard in enumerate(shards):
        sequence, offset, _ = _split_index(lengths, cp_size, rank)
        if shard.shape[1] != len(offset):
            raise ValueError(
                f"shard {rank} has {shard.shape[1]} tokens, expected {len(offset)} for this layout."
            )
        valid = offset < lengths[sequence]
        out[:, (starts[sequence] + offset)[valid]] = shard[:, valid]
    return out
