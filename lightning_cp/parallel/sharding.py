"""Shift-then-split of batches along the sequence for context parallelism, and the inverse.

``shard_batch`` runs on every rank on the *full* sequence, before any model code (``docs/design.md``,
"How one batch flows"):

1. labels become the next token (within each packed sequence; the last token of a sequence has none),
   ``loss_mask`` is rolled the same way, ``position_ids`` are taken from the full sequence;
2. every sequence is padded to a multiple of ``2 * cp`` (padding is never a target) and cut into
   ``2 * cp`` equal chunks; CP rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` (:class:`CPSplit`);
3. what attention needs to find every key of every local query, and which sequence every local token
   belongs to (:class:`CPShard`), is computed once and carried in the batch, so no layer or metric
   recomputes it.

The kept chunks balance the causal-attention work over ranks (an early chunk is cheap, a late one
expensive). For padded ``[B, S]`` batches the layout is identical to Megatron-core's
``get_batch_on_this_cp_rank``; for packed ``[1, T]`` batches every sequence is split on its own, as
TransformerEngine's THD layout does, so each rank holds two pieces of every sequence. All index
arithmetic is vectorized over sequences.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lightning_cp.constants import (
    CP_SHARD,
    CU_SEQLENS,
    CU_SEQLENS_PADDED,
    IGNORE_INDEX,
    INPUT_IDS,
    INPUT_MASK,
    LABELS,
    LOSS_MASK,
    POSITION_IDS,
    TARGET_KEYS,
)
from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.layout import ProcessGroup
from lightning_cp.parallel.offsets import boundaries, starts
from lightning_cp.parallel.shard import CPShard
from lightning_cp.parallel.split import CPSplit

_PACKED_KEYS = (CU_SEQLENS, CU_SEQLENS_PADDED)
_DERIVED_KEYS = (LABELS, LOSS_MASK, INPUT_MASK, POSITION_IDS, CP_SHARD)
# An attribute of the position_ids and input_ids tensors of a batch split over cp > 1 ranks (sharded_under_cp).
_SHARDED_UNDER_CP = "_lightning_cp_sharded_under_cp"
PADDING_MASK = "attention_mask"
"""The key of a ``[B, S]`` padding mask in a batch (1 on tokens, 0 on padding), as Hugging Face tokenizers
make it: :func:`shard_batch` records whether it masks a token before the split (:meth:`CPShard.masks_tokens`)."""


def sharded_under_cp(tensor: Any) -> bool:
    """Whether ``tensor`` is the ``position_ids`` or the ``input_ids`` tensor of a batch :func:`shard_batch`
    split over ``cp_size > 1`` ranks.

    A model called on such a batch without its ``cp_shard`` would attend within this rank's shard only;
    attention (``position_ids``) and a check of the model's call (``input_ids``) use this to refuse. The
    mark is an attribute of those tensor objects: it lives and dies with the batch, and no other tensor
    (another batch, a copy) carries it. Local, no communication.
    """
    return getattr(tensor, _SHARDED_UNDER_CP, False)


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
    labels = batch.get(LABELS, input_ids)
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"batch['labels'] has shape {tuple(labels.shape)}, expected input_ids' {tuple(input_ids.shape)}."
        )
    target = labels != ignore_index
    if LOSS_MASK in batch:
        loss_mask = batch[LOSS_MASK]
        if loss_mask.shape != input_ids.shape:
            raise ValueError(
                f"batch['loss_mask'] has shape {tuple(loss_mask.shape)}, expected input_ids' {tuple(input_ids.shape)}."
            )
        target = target & loss_mask.bool()
    next_target = torch.roll(target, -1, dims=1) & ~last
    next_labels = torch.where(next_target, torch.roll(labels, -1, dims=1), ignore_index)
    return next_labels, next_target


def _shift_with_targets(key: str, value: Any, input_ids: Tensor, next_target: Tensor) -> Tensor:
    """``value`` (about each token, like ``labels``) moved onto the position that predicts its token, 0 where
    that position has no target."""
    if not isinstance(value, Tensor) or value.shape != input_ids.shape or not value.is_floating_point():
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"batch[{key!r}] must be a float tensor of input_ids' shape {tuple(input_ids.shape)} (one value "
            f"per token, on the token it is about), got {shape}."
        )
    return torch.where(next_target, torch.roll(value, -1, dims=1), 0.0)


def _gather_tokens(value: Tensor, src: Tensor, valid: Tensor, rows: int, fill: float) -> Tensor:
    """``[rows, T_local / rows, ...]``: the tokens ``src`` of ``value`` flattened over its first two dims,
    with ``fill`` where ``valid`` is False (padding)."""
    flat = value.flatten(0, 1)
    picked = flat.index_select(0, src.clamp(max=len(flat) - 1))
    mask = valid.view(-1, *([1] * (value.dim() - 2)))
    filled = torch.where(mask, picked, torch.as_tensor(fill, dtype=value.dtype, device=value.device))
    return filled.view(rows, -1, *value.shape[2:])


def shard_batch(
    batch: Mapping[str, Any],
    cp_size: int,
    cp_rank: int,
    *,
    cp_group: ProcessGroup | GroupExchange | None = None,
    attention: AttentionMode | None = None,
    ignore_index: int = IGNORE_INDEX,
    pad_id: int = 0,
) -> dict[str, Any]:
    """Shift labels to the next token, pad and keep this CP rank's two chunks of every sequence.

    Every CP peer calls it on the same full batch. Local, but for one all-reduce of one integer over
    ``cp_group`` on CUDA when the all-gather's rounds are sized by free memory (``attention``).

    Args:
        batch: ``input_ids`` ``[B, S]`` (padded) or ``[1, T]`` with ``cu_seqlens`` ``[n + 1]`` (packed).
            Optional ``labels`` (aligned with ``input_ids``, as in Hugging Face: *not* shifted; defaults to
            ``input_ids``), ``loss_mask`` (aligned with ``input_ids``: 1 where the token is a target) and
            ``position_ids``, ``input_mask`` (1 on real tokens, 0 on collate padding), and the float values
            about a target token of reinforcement learning (``advantages``, ``old_logprobs``, ``ref_logprobs``:
            :data:`~lightning_cp.constants.TARGET_KEYS`, on the token they are about, as ``labels``). Every other tensor
            whose first two dims are those of ``input_ids`` is split the same way (padded with zeros);
            anything else passes through unchanged.
        cp_size: number of ranks in the context-parallel group.
        cp_rank: this rank's index in it.
        cp_group: the CP process group (``layout.cp_group``) or its :class:`GroupExchange`, which the
            shard carries to every layer that reaches the other ranks (attention). Needed to run a model
            on the shard when ``cp_size > 1``; its size and this rank's index in it must be ``cp_size`` and
            ``cp_rank``. ``None``: a shard of the data only (under CP, attention refuses it).
        attention: how the batch's attention layers reach the other ranks' tokens (:class:`AttentionMode`:
            all-gather by rounds of key/value heads, or Ulysses); default: the all-gather, all heads at once
            on the CPU. With ``kv_heads_per_gather=None`` on CUDA under CP, the rounds' memory budget is
            agreed over ``cp_group`` here, once for the batch (:attr:`CPShard.kv_gather_budget`).
        ignore_index: label of positions that are not targets.
        pad_id: token id used to pad sequences to a multiple of ``2 * cp_size``.

    Returns:
        A new dict with this rank's tokens: ``input_ids``, ``labels`` (next token, ``ignore_index`` where
        not a target), ``loss_mask`` (float32, 1 on targets), ``position_ids`` (position inside the
        sequence, int64; with ``cp_size > 1`` marked for :func:`sharded_under_cp`), ``input_mask`` (bool,
        False on padding, including the padding added here, so token counts need no knowledge of the
        split), the target values shifted with the labels (the value at ``t`` belongs to the label at ``t``; 0
        where there is none), the other sequence tensors, ``cp_shard`` (the :class:`CPShard` the model's attention is
        given), and for packed batches ``cu_seqlens`` (this rank's local boundaries, int32) and
        ``cu_seqlens_padded`` (boundaries of the padded full sequence, int32). An ``attention_mask`` is
        split as the other sequence tensors, and the shard records whether the whole batch's masks a token
        (:meth:`CPShard.masks_tokens`).
        Local length is ``S_pad / cp`` (padded) or ``sum(len_pad_i) / cp`` (packed).

    Raises:
        ValueError: no ``input_ids``, wrong shapes or dtypes, or ``cu_seqlens`` that do not cover the tokens.
        TypeError / ValueError: a ``cp_size`` / ``cp_rank`` that is not a valid split (see :class:`CPSplit`),
            or a ``cp_group`` of another size or rank.
    """
    split = CPSplit(cp_size, cp_rank)
    exchange = _check_group(cp_group, split)
    if not isinstance(batch, Mapping) or INPUT_IDS not in batch:
        keys = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(
            f"A context-parallel batch must be a dict with 'input_ids' [B, S] (or [1, T] with 'cu_seqlens'); got {keys}."
        )
    input_ids = batch[INPUT_IDS]
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"batch['input_ids'] must be a 2-D integer tensor [B, S], got {input_ids!r}.")
    rows, seq_len = input_ids.shape
    device = input_ids.device
    packed = batch.get(CU_SEQLENS) is not None

    if packed:
        if rows != 1:
            raise ValueError(
                f"A packed batch (with 'cu_seqlens') must have input_ids of shape [1, T], got {tuple(input_ids.shape)}."
            )
        lengths_cpu = _check_cu_seqlens(batch[CU_SEQLENS], seq_len).diff()
    else:
        lengths_cpu = torch.full((rows,), seq_len)
    # A padded batch is B sequences of one length; a packed one, the documents of its row. Sequences are
    # addressed in the batch's tokens flattened row-major.
    shard = CPShard.build(split, lengths_cpu, device)
    lengths = lengths_cpu.to(device)
    first = starts(lengths)
    last = torch.zeros_like(input_ids, dtype=torch.bool)
    last.view(-1)[first + lengths - 1] = True
    labels, target = _shift_targets(input_ids, batch, last, ignore_index)

    sequence, offset = shard.sequence_index, shard.token_offset
    valid = offset < lengths[sequence]
    src = first[sequence] + offset

    def gather(value: Tensor, fill: float) -> Tensor:
        return _gather_tokens(value, src, valid, rows, fill)

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _PACKED_KEYS or key in _DERIVED_KEYS:
            continue
        if key in TARGET_KEYS:
            value = _shift_with_targets(key, value, input_ids, target)
        if isinstance(value, Tensor) and value.shape[:2] == input_ids.shape:
            value = gather(value, pad_id if key == INPUT_IDS else 0)
        out[key] = value
    input_mask = batch.get(INPUT_MASK, torch.ones_like(input_ids, dtype=torch.bool))
    out[INPUT_MASK] = gather(input_mask.bool(), False)
    out[LABELS] = gather(labels, ignore_index)
    out[LOSS_MASK] = gather(target, False).float()
    position_ids = offset.view(rows, -1)
    if POSITION_IDS in batch:
        position_ids = torch.where(valid.view(rows, -1), gather(batch[POSITION_IDS], 0), position_ids)
    out[POSITION_IDS] = position_ids = position_ids.to(torch.int64).contiguous()
    if cp_size > 1:
        for marked in (position_ids, out.get(INPUT_IDS)):
            if isinstance(marked, Tensor):
                setattr(marked, _SHARDED_UNDER_CP, True)
    attention = attention or AttentionMode()
    padding = batch.get(PADDING_MASK)
    padded = isinstance(padding, Tensor) and padding.shape == input_ids.shape
    out[CP_SHARD] = replace(
        shard,
        position_ids=position_ids,
        exchange=exchange,
        attention=attention,
        kv_gather_budget=attention.gather_budget(device, exchange),
        padding_mask=out[PADDING_MASK] if padded else None,
        batch_padded=~padding.bool().all() if padded else None,
    )
    if packed:
        out[CU_SEQLENS] = shard.cu_seqlens
        out[CU_SEQLENS_PADDED] = boundaries(shard.sequence_lengths).to(device)
    return out


def _check_group(group: ProcessGroup | GroupExchange | None, split: CPSplit) -> GroupExchange | None:
    """``group`` as the exchange of ``split``'s CP group, checked to have its size and rank."""
    if group is None:
        return None
    exchange = group if isinstance(group, GroupExchange) else GroupExchange(group)
    if (exchange.size, exchange.rank) != (split.cp_size, split.cp_rank):
        raise ValueError(
            f"shard_batch(cp_size={split.cp_size}, cp_rank={split.cp_rank}) was given a cp_group of "
            f"{exchange.size} ranks in which this is rank {exchange.rank}: pass the layout's cp, cp_rank and "
            "cp_group together."
        )
    return exchange


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
        sequence, offset, _ = CPSplit(cp_size, rank).positions(lengths)
        if shard.shape[1] != len(offset):
            raise ValueError(
                f"shard {rank} has {shard.shape[1]} tokens, expected {len(offset)} for this split."
            )
        valid = offset < lengths[sequence]
        out[:, (starts[sequence] + offset)[valid]] = shard[:, valid]
    return out
