"""The head-tail rule: which two of the ``2 * cp`` chunks of every sequence a CP rank keeps.

The one place that knows the rule. :func:`~lightning_cp.parallel.shard_batch` gathers the tokens it names,
:class:`~lightning_cp.parallel.CPShard` describes them to the model, the attention's key selection
(:mod:`lightning_cp.parallel._key_selection`) and the head-parallel exchange put them back in sequence
order, and :func:`~lightning_cp.parallel.unshard` inverts it. Imports nothing of the package but the size check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_cp.parallel.layout import check_size
from lightning_cp.parallel.offsets import starts


@dataclass(frozen=True)
class CPSplit:
    """The load-balanced split of sequences over a CP group, for one rank.

    Every sequence is padded to a multiple of ``2 * cp_size`` and cut into ``2 * cp_size`` equal chunks;
    rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r`` (a cheap early chunk and an expensive late
    one, which balances causal attention). This is the only place that knows the rule: ``shard_batch``,
    ``unshard``, the attention metadata (:class:`CPShard`) and the attention kernels all ask it.

    Raises:
        TypeError / ValueError: ``cp_size`` is not an integer >= 1, or ``cp_rank`` not in ``[0, cp_size)``.
    """

    cp_size: int
    cp_rank: int

    def __post_init__(self) -> None:
        check_size("cp_size", self.cp_size)
        if isinstance(self.cp_rank, bool) or not isinstance(self.cp_rank, int):
            raise TypeError(f"cp_rank={self.cp_rank!r} must be an integer in [0, {self.cp_size}).")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank={self.cp_rank} must be in [0, cp_size={self.cp_size}).")

    @property
    def kept_chunks(self) -> tuple[int, int]:
        """The indices (of ``2 * cp_size``) of the two chunks this rank keeps, in local order."""
        return self.cp_rank, 2 * self.cp_size - 1 - self.cp_rank

    def owner(self, chunk: Tensor) -> tuple[Tensor, Tensor]:
        """Who keeps each of the global chunk indices ``chunk`` (any shape, in ``[0, 2 * cp_size)``).

        Returns:
            ``(rank, slot)``, both shaped like ``chunk`` (int64): the CP rank that keeps the chunk, and
            whether it is that rank's first (0) or second (1) kept chunk.
        """
        second = chunk >= self.cp_size
        return torch.where(second, 2 * self.cp_size - 1 - chunk, chunk), second.long()

    def chunk_lengths(self, lengths: Tensor) -> Tensor:
        """``[n]`` chunk length of each sequence: ``ceil(length / (2 * cp_size))``."""
        return torch.div(lengths + 2 * self.cp_size - 1, 2 * self.cp_size, rounding_mode="floor")

    def positions(self, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Which tokens of each sequence this rank keeps, in its local order.

        Args:
            lengths: ``[n]`` int64, the unpadded length of each sequence.

        Returns:
            ``(sequence, offset, local_lengths)``: for each local token, the index of its sequence
            ``[T_local]`` and its position inside that sequence after padding ``[T_local]``
            (``offset >= length`` marks padding); and the number of local tokens of each sequence ``[n]``
            (``2 * chunk_length``).
        """
        chunk = self.chunk_lengths(lengths)
        local_lengths = 2 * chunk
        total = int(local_lengths.sum())
        sequence = torch.repeat_interleave(
            torch.arange(len(lengths), device=lengths.device), local_lengths, output_size=total
        )
        j = torch.arange(total, device=lengths.device) - starts(local_lengths)[sequence]
        c = chunk[sequence]
        first, second = self.kept_chunks
        offset = torch.where(j >= c, second * c + (j - c), first * c + j)
        return sequence, offset, local_lengths

    def gathered_rows(self, chunk_lengths: Tensor, sequence: Tensor, position: Tensor) -> Tensor:
        """Where tokens of the sequences sit among the ranks' local tokens.

        Args:
            chunk_lengths: ``[n]`` int64, each sequence's chunk length.
            sequence, position: ``[k]`` int64, each token's sequence and its position in that sequence
                padded to its ``2 * cp_size`` chunks.

        Returns:
            ``[k]`` int64: each token's row in the rank-major concatenation of every rank's ``T_local``
            local tokens (what an all-gather or all-to-all over the group returns).
        """
        local = 2 * chunk_lengths
        chunk_length = chunk_lengths[sequence]
        chunk = torch.div(position, chunk_length, rounding_mode="floor")
        rank, slot = self.owner(chunk)
        local_start = starts(local)[sequence]
        return rank * int(local.sum()) + local_start + slot * chunk_length + position - chunk * chunk_length

    def sequence_order(self, chunk_lengths: Tensor) -> Tensor:
        """:meth:`gathered_rows` of every token of the whole sequences in sequence order (sequence after
        sequence, each padded to its ``2 * cp_size`` chunks): ``[cp_size * T_local]`` int64, a permutation.
        Computed on ``chunk_lengths``' device."""
        device = chunk_lengths.device
        padded = 2 * self.cp_size * chunk_lengths
        total = int(padded.sum())
        sequence = torch.repeat_interleave(
            torch.arange(len(padded), device=device), padded, output_size=total
        )
        position = torch.arange(total, device=device) - starts(padded)[sequence]
        return self.gathered_rows(chunk_lengths, sequence, position)
