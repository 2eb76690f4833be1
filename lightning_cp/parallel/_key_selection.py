"""Which keys every query piece of CP attention attends to, for full causal or sliding-window attention.

CP attention (:mod:`lightning_cp.parallel.attention`) cuts this rank's queries into *pieces*, one per
kept chunk of every sequence (:class:`~lightning_cp.parallel.CPShard`): piece ``(i, h)`` holds the ``c``
queries at positions ``g * c .. (g + 1) * c - 1`` of sequence ``i`` (``g = kept_chunks[h]``, ``c`` its
chunk length). With full causal attention they see the sequence's keys ``0 .. (g + 1) * c - 1``; with a
sliding window of ``w`` tokens (query ``p`` sees key ``j`` iff ``p - w < j <= p``, ``transformers``'
``sliding_window_overlay``) the piece's first query sees nothing before ``g * c - w + 1``, so its keys
start there. In both cases a piece's queries are the last keys of its range (bottom-right alignment),
which is what the kernels of :mod:`lightning_cp.parallel._varlen` expect.

The selection is computed on the CPU from the chunk lengths (no device synchronization) and cached on the
shard per window size: a model whose layers alternate windowed and global attention builds two, once per
batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_cp.parallel._varlen import Pieces

if TYPE_CHECKING:
    from lightning_cp.parallel.sharding import CPSplit


@dataclass(frozen=True, eq=False)
class KeySelection:
    """The variable-length problem of one rank: its query pieces and, for each, the keys it attends to.

    The pieces' keys form one packed ``[K]`` sequence described by ``cu_keys``; the queries are this
    rank's ``[T_local]`` tokens described by ``cu_queries``: the layout ``flash_attn_varlen_func`` takes,
    with no ``[T_local, T_total]`` mask.
    """

    window: int | None
    """The sliding window the kernels apply (``None``: full causal; a window at least as long as every
    sequence is ``None`` here)."""
    pieces: Pieces
    """``(q_start, q_stop, k_start, k_stop)`` of every piece on the host, for the blocked kernel."""
    cu_queries: Tensor
    """``[P + 1]`` int32: boundaries of the query pieces in the ``T_local`` tokens."""
    cu_keys: Tensor
    """``[P + 1]`` int32: boundaries of the pieces' keys in the ``[K]`` selection."""
    key_index: Tensor | None
    """``[K]`` int64: position of every selected key in the all-gathered ``[gathered_tokens]`` keys of
    the CP group (rank-major). ``None``: the selected keys are this rank's own tokens, in order (no CP:
    each piece is a whole row), and nothing is gathered."""
    gathered_tokens: int
    """Length of the gathered key order ``key_index`` points into (``cp * T_local``)."""
    max_queries: int
    """Longest query piece."""
    max_keys: int
    """Longest key piece."""

    @property
    def num_keys(self) -> int:
        """``K``: the selected keys of all pieces (what one layer's gathered K/V are reduced to)."""
        return self.gathered_tokens if self.key_index is None else self.key_index.numel()


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
    chunk = chunk_lengths
    n, cp = len(chunk), split.cp_size
    kept = torch.tensor(split.kept_chunks)
    local_lengths = 2 * chunk
    local_starts = torch.cumsum(local_lengths, 0) - local_lengths
    local_total = int(local_lengths.sum())
    # Piece (i, h): keys at positions [first, stop) of sequence i (padded positions, chunk-major).
    stop = ((kept + 1).unsqueeze(0) * chunk.unsqueeze(1)).flatten()
    first = torch.zeros_like(stop)
    if window is not None:
        first = (stop - chunk.repeat_interleave(2) - (window - 1)).clamp(min=0)
    key_lengths = stop - first
    key_total = int(key_lengths.sum())
    # For every selected key: its sequence, and its position p in that (padded) sequence.
    key_sequence = torch.arange(n).repeat_interleave(2).repeat_interleave(key_lengths, output_size=key_total)
    piece_starts = torch.cumsum(key_lengths, 0) - key_lengths
    p = torch.arange(key_total) + (first - piece_starts).repeat_interleave(key_lengths, output_size=key_total)
    c = chunk[key_sequence]
    global_chunk = torch.div(p, c, rounding_mode="floor")
    owner, slot = split.owner(global_chunk)
    key_index = owner * local_total + local_starts[key_sequence] + slot * c + (p - global_chunk * c)
    query_lengths = chunk.repeat_interleave(2)
    cu_queries, cu_keys = _boundaries(query_lengths), _boundaries(key_lengths)
    return KeySelection(
        window=window,
        pieces=_host_pieces(cu_queries, cu_keys),
        cu_queries=_to(cu_queries, device),
        cu_keys=_to(cu_keys, device),
        key_index=_to(key_index, device),
        gathered_tokens=cp * local_total,
        max_queries=int(chunk.max()) if n else 0,
        max_keys=int(key_lengths.max()) if n else 0,
    )


def select_row_keys(rows: int, length: int, window: int | None, device: torch.device) -> KeySelection:
    """Without CP or a shard: each of ``rows`` rows of ``length`` tokens is one sequence, all local."""
    bounds = torch.arange(rows + 1, dtype=torch.int32) * length
    on_device = _to(bounds, device)
    return KeySelection(
        window=effective_window(window, length),
        pieces=_host_pieces(bounds, bounds),
        cu_queries=on_device,
        cu_keys=on_device,
        key_index=None,
        gathered_tokens=rows * length,
        max_queries=length,
        max_keys=length,
    )


def _to(x: Tensor, device: torch.device) -> Tensor:
    # From pageable memory, CUDA stages the copy before returning, so no stream synchronization is needed.
    return x.to(device, non_blocking=True)


def _boundaries(lengths: Tensor) -> Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)


def _host_pieces(cu_queries: Tensor, cu_keys: Tensor) -> Pieces:
    q, k = cu_queries.tolist(), cu_keys.tolist()
    return list(zip(q[:-1], q[1:], k[:-1], k[1:], strict=True))
