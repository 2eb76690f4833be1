"""Which keys every query piece of CP attention attends to, and where the kernels read them in place.

CP attention (:mod:`lightning_cp.parallel._allgather_attention`) cuts this rank's queries into *pieces*, one per
kept chunk of every sequence (:class:`~lightning_cp.parallel.CPShard`): piece ``(i, h)`` holds the ``c``
queries at positions ``g * c .. (g + 1) * c - 1`` of sequence ``i`` (``g = kept_chunks[h]``, ``c`` its
chunk length). With full causal attention they see the sequence's keys ``0 .. (g + 1) * c - 1``; with a
sliding window of ``w`` tokens (query ``p`` sees key ``j`` iff ``p - w < j <= p``, ``transformers``'
``sliding_window_overlay``) the piece's first query sees nothing before ``g * c - w + 1``, so its keys
start there. In both cases a piece's queries are the last keys of its range (bottom-right alignment),
which is what the kernels of :mod:`lightning_cp.parallel._varlen` expect.

The all-gathered keys arrive rank-major (every rank's two chunks of every sequence). They are put in
*sequence order* once (:attr:`KeySelection.order`): for every sequence, the keys its two pieces read (with
full causal attention, chunks ``0 .. 2 * cp - 1 - r`` of rank ``r``: the later chunks are read by no piece
of this rank), in position order. A piece's keys are then one contiguous range of that buffer, and the two
pieces of a sequence share theirs (the early chunk's keys are a prefix of the late chunk's, the Llama 3
all-gather layout): the blocked kernel reads every piece in place, and FlashAttention-2 runs one varlen call
per kept chunk (:class:`VarlenCall`), reading keys in place wherever the pieces' ranges lie back to back.
No per-piece copy of the keys exists (before, each rank selected ``(2 cp + 1) / (2 cp)`` of the sequence's
K/V besides the gathered buffer, and the backward summed the pieces' gradients into a zero-filled
full-sequence buffer).

Without CP (``cp = 1``, or no shard) each sequence is one piece of local keys and nothing is gathered.

The selection is computed on the CPU from the chunk lengths (no device synchronization) and cached on the
shard per window size: a model whose layers alternate windowed and global attention builds two, once per
batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_cp.parallel._varlen import Pieces
from lightning_cp.parallel.offsets import boundaries, starts
from lightning_cp.parallel.shard import CPShard
from lightning_cp.parallel.split import CPSplit

Rows = slice | Tensor
"""Rows of a token-major tensor: a contiguous range, or an int64 index ``[n]`` on the tensors' device."""


@dataclass(frozen=True, eq=False)
class VarlenCall:
    """One call of a variable-length kernel: some query pieces and their keys, each piece contiguous.

    The call's queries are ``q[queries]`` (its pieces back to back, ``cu_queries`` their boundaries) and its
    keys ``keys_in_sequence_order[keys]`` (``cu_keys``): the layout ``flash_attn_varlen_func`` takes.
    A slice is read in place; an index is a copy of only this call's rows.
    """

    queries: Rows
    """Rows of this rank's ``[T_local]`` queries, piece after piece."""
    keys: Rows
    """Rows of the keys in sequence order (:attr:`KeySelection.order`), piece after piece."""
    cu_queries: Tensor
    """``[p + 1]`` int32: boundaries of the call's query pieces."""
    cu_keys: Tensor
    """``[p + 1]`` int32: boundaries of the call's key pieces."""
    max_queries: int
    """Longest query piece."""
    max_keys: int
    """Longest key piece."""


@dataclass(frozen=True, eq=False)
class KeySelection:
    """The variable-length problem of one rank: its query pieces and, for each, the keys it attends to.

    Keys are addressed in *sequence order*: the ``[K]`` rows ``order`` picks from the all-gathered keys.
    Pieces may share keys (their ranges overlap); no ``[T_local, T_total]`` mask exists.
    """

    window: int | None
    """The sliding window the kernels apply (``None``: full causal; a window at least as long as every
    sequence is ``None`` here)."""
    pieces: Pieces
    """``(q_start, q_stop, k_start, k_stop)`` of every piece on the host, for the blocked kernel: query rows
    of this rank's ``[T_local]`` tokens, key rows of the ``[K]`` keys in sequence order."""
    calls: tuple[VarlenCall, ...]
    """The same pieces as calls of FlashAttention-2's varlen kernels (one per kept chunk under CP; the one
    that reads every key first, so that its key gradients can take the others')."""
    order: Tensor | None
    """``[K]`` int64: the row of the all-gathered ``[gathered_tokens]`` keys (rank-major) of every key in
    sequence order, each row at most once. ``None``: the keys are this rank's own tokens, already in
    sequence order (no CP), and nothing is gathered."""
    gathered_tokens: int
    """Length of the gathered key order ``order`` points into (``cp * T_local``)."""

    @property
    def num_keys(self) -> int:
        """``K``: the keys in sequence order (what one layer's gathered K/V are reduced to)."""
        return self.gathered_tokens if self.order is None else self.order.numel()


def effective_window(window: int | None, longest: int) -> int | None:
    """``window``, or ``None`` when it covers sequences of up to ``longest`` tokens whole (no effect)."""
    return None if window is None or window >= longest else window


def select_keys(
    split: CPSplit, chunk_lengths: Tensor, window: int | None, device: torch.device
) -> KeySelection:
    """The keys of every piece of this rank's sequences, whose chunk lengths are ``chunk_lengths`` ``[n]``.

    ``window`` as :func:`effective_window` returns it. Computed on the CPU from ``chunk_lengths`` (int64,
    CPU); the index tensors are then copied to ``device`` without waiting for it.
    """
    if split.cp_size == 1:  # chunks 0 and 1 of every sequence: the whole sequence, local and in order
        return _local_selection(2 * chunk_lengths, window, device)
    c, n = chunk_lengths, len(chunk_lengths)
    local_lengths = 2 * c
    local_starts = starts(local_lengths)
    local_total = int(local_lengths.sum())
    # Piece (i, h) reads the keys at positions [first[i, h], stop[i, h]) of sequence i (padded positions).
    stop = (torch.tensor(split.kept_chunks) + 1) * c.unsqueeze(1)
    first = torch.zeros_like(stop) if window is None else (stop - c.unsqueeze(1) - (window - 1)).clamp(min=0)
    # Each sequence keeps the union of its pieces' ranges: one interval when they meet, else two.
    merged = first[:, 1] <= stop[:, 0]
    lower_stop = torch.where(merged, stop[:, 1], stop[:, 0])
    upper_first = torch.where(merged, stop[:, 1], first[:, 1])
    intervals = torch.stack([first[:, 0], lower_stop, upper_first, stop[:, 1]], 1).view(n, 2, 2)
    kept = intervals[..., 1] - intervals[..., 0]  # [n, 2] keys of each interval (the second may be empty)
    key_starts = starts(kept.sum(1))
    # Where each piece's range starts in its sequence's kept keys.
    offset = torch.stack([torch.zeros_like(c), torch.where(merged, first[:, 1] - first[:, 0], kept[:, 0])], 1)
    key_first = key_starts.unsqueeze(1) + offset
    key_lengths = stop - first
    query_first = local_starts.unsqueeze(1) + torch.tensor([0, 1]) * c.unsqueeze(1)
    order = _gathered_rows(split, c, intervals)
    pieces = [
        (q0, q0 + ci, k0, k0 + kl)
        for q_row, k_row, l_row, ci in zip(
            query_first.tolist(), key_first.tolist(), key_lengths.tolist(), c.tolist(), strict=True
        )
        for q0, k0, kl in zip(q_row, k_row, l_row, strict=True)
    ]
    # Chunk 2 cp - 1 - r's call first: with full causal attention it reads every key, in place.
    calls = tuple(_call(query_first[:, h], c, key_first[:, h], key_lengths[:, h], device) for h in (1, 0))
    return KeySelection(
        window=window,
        pieces=pieces,
        calls=calls,
        order=_to(order, device),
        gathered_tokens=split.cp_size * local_total,
    )


def shard_keys(shard: CPShard, window: int | None = None) -> KeySelection:
    """Which gathered keys every piece of ``shard`` attends to: causal, or within a sliding ``window`` of
    tokens. Built on the CPU on the first call for each (effective) window and kept on the shard for the batch
    (:meth:`CPShard.cached <lightning_cp.parallel.shard.CPShard.cached>`), so every layer with that window
    reuses it; the index tensors on the shard's device."""
    longest = int(shard.sequence_lengths.max()) if shard.num_sequences else 0
    return shard.cached(_shard_selection, effective_window(window, longest))


def _shard_selection(shard: CPShard, window: int | None) -> KeySelection:
    return select_keys(shard.split, shard.chunk_lengths, window, shard.cu_seqlens.device)


def select_row_keys(rows: int, length: int, window: int | None, device: torch.device) -> KeySelection:
    """Without CP or a shard: each of ``rows`` rows of ``length`` tokens is one sequence, all local."""
    return _local_selection(torch.full((rows,), length), effective_window(window, length), device)


def _local_selection(lengths: Tensor, window: int | None, device: torch.device) -> KeySelection:
    """Every sequence (``lengths`` ``[n]`` tokens, back to back) one piece over its own local keys."""
    first = starts(lengths)
    total = int(lengths.sum())
    pieces = [(a, a + length, a, a + length) for a, length in zip(first.tolist(), lengths.tolist())]
    call = _call(first, lengths, first, lengths, device)
    return KeySelection(window=window, pieces=pieces, calls=(call,), order=None, gathered_tokens=total)


def _gathered_rows(split: CPSplit, c: Tensor, intervals: Tensor) -> Tensor:
    """``[K]``: the rank-major gathered row of every kept key, sequence after sequence, in position order.

    ``intervals`` ``[n, 2, 2]`` are each sequence's kept ``[start, stop)`` positions.
    """
    lengths = (intervals[..., 1] - intervals[..., 0]).flatten()
    total = int(lengths.sum())
    interval_starts = starts(lengths)
    position = torch.arange(total) + (intervals[..., 0].flatten() - interval_starts).repeat_interleave(
        lengths, output_size=total
    )
    sequence = torch.arange(len(c)).repeat_interleave(2).repeat_interleave(lengths, output_size=total)
    return split.gathered_rows(c, sequence, position)


def _call(
    query_first: Tensor, query_lengths: Tensor, key_first: Tensor, key_lengths: Tensor, device: torch.device
) -> VarlenCall:
    """The :class:`VarlenCall` of pieces whose query and key ranges start at ``*_first`` ``[p]``."""
    return VarlenCall(
        queries=_rows(query_first, query_lengths, device),
        keys=_rows(key_first, key_lengths, device),
        cu_queries=_to(boundaries(query_lengths), device),
        cu_keys=_to(boundaries(key_lengths), device),
        max_queries=int(query_lengths.max()) if len(query_lengths) else 0,
        max_keys=int(key_lengths.max()) if len(key_lengths) else 0,
    )


def _rows(first: Tensor, lengths: Tensor, device: torch.device) -> Rows:
    """The ranges ``[first, first + lengths)``, back to back: a slice when they already are, else an index."""
    if len(first) == 0:
        return slice(0, 0)
    if bool((first[1:] == first[:-1] + lengths[:-1]).all()):
        return slice(int(first[0]), int(first[-1] + lengths[-1]))
    total = int(lengths.sum())
    index = torch.arange(total) + (first - starts(lengths)).repeat_interleave(lengths, output_size=total)
    return _to(index, device)


def _to(x: Tensor, device: torch.device) -> Tensor:
    # From pageable memory, CUDA stages the copy before returning, so no stream synchronization is needed.
    return x.to(device, non_blocking=True)
