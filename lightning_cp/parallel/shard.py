"""This rank's shard of a batch: its tokens, the sequences they belong to, their CP group and attention mode.

:class:`CPShard` is the data every layer of a batch shares (built once by
:func:`~lightning_cp.parallel.shard_batch`); what a kernel needs beyond it (the attention's key selection, the
head-parallel exchange's orders, the indexer's rows) the kernel derives and keeps on the shard for the batch
through :meth:`CPShard.cached`, next to its own code.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.offsets import boundaries
from lightning_cp.parallel.split import CPSplit

T = TypeVar("T")


class _BatchState:
    """What a :class:`CPShard` holds for its batch besides its data: what kernels derived from it
    (:meth:`CPShard.cached`) and whether a layer reached the other ranks.

    Not a dataclass nor a container: FSDP's ``cast_forward_inputs`` (and ``torch.distributed``'s
    ``_apply_to_tensors``) rebuild dataclasses, lists and dicts in a forward's arguments, so the copy of the
    shard a model receives under FSDP's mixed precision shares this one object with the batch's shard.
    """

    def __init__(self) -> None:
        self.derived: dict[tuple[Callable[..., Any], tuple[Hashable, ...]], Any] = {}
        self.reached = False


@dataclass(frozen=True, eq=False)
class CPShard:
    """This rank's shard of a batch's sequences under a :class:`CPSplit`: its tokens and their keys.

    Built once per batch by :func:`shard_batch` (``batch["cp_shard"]``) and passed to the model as an
    argument (``cp_shard=batch["cp_shard"]``), which hands it to every attention layer; the loss metrics
    read its :attr:`sequence_index`, and ``shard_batch`` gathers the tokens it lists. It carries the CP group
    the batch was split over (:attr:`exchange`), so a layer that reaches its peers finds them here, with the
    tokens they belong to, and no layer looks the group up elsewhere. A *sequence* is a
    row of a padded ``[B, S]`` batch or a document of a packed ``[1, T]`` one; this rank's ``T_local``
    tokens (the batch flattened row-major) hold, sequence after sequence, the two kept chunks of each.
    Attention splits them into *pieces* (one per kept chunk, ``2 * n`` in all): piece ``(i, h)`` holds
    the queries of chunk ``g = kept_chunks[h]`` of sequence ``i``, which attend causally (bottom-right
    aligned) to the first ``(g + 1) * chunk_lengths[i]`` keys of that sequence, or, with a sliding
    window, to those the window reaches (:meth:`keys`).
    """

    split: CPSplit
    """The CP split this batch was sharded with."""
    chunk_lengths: Tensor
    """``[n]`` int64 on the CPU: the chunk length of each sequence (its padded length is ``2 * cp`` times it)."""
    cu_seqlens: Tensor
    """``[n + 1]`` int32: boundaries of the sequences in this rank's ``T_local`` tokens."""
    sequence_index: Tensor
    """``[T_local]`` int64: the sequence (``0 <= i < n``) of every local token, in the batch's row-major
    order; the same numbering on every CP rank (per-sequence metrics add up the ranks' pieces by it)."""
    token_offset: Tensor
    """``[T_local]`` int64: the index of every local token in its sequence padded to ``2 * cp`` chunks
    (at least the sequence's length on the padding added by the split)."""
    position_ids: Tensor | None = None
    """``[B, S_local]`` int64: the batch's ``position_ids`` (the same tensor), which a model must be given
    with this shard; ``None`` for a shard built without a batch."""
    exchange: GroupExchange | None = None
    """The collectives of the CP group the batch was split over (``split.cp_size`` ranks, this one
    ``split.cp_rank``); ``None`` for a shard built without its group (only a split over one rank needs none)."""
    attention: AttentionMode = field(default_factory=AttentionMode)
    """How every attention layer of the batch reaches the other ranks' tokens (all-gather or Ulysses)."""
    kv_gather_budget: int | None = None
    """Bytes one all-gather round's key/value copies may take, the same on every rank of the CP group
    (:meth:`AttentionMode.gather_budget <lightning_cp.parallel.attention_mode.AttentionMode.gather_budget>`,
    asked once per batch by :func:`shard_batch`); ``None``: no budget. Every attention layer of the batch,
    and a checkpointed layer's recomputation, sizes its rounds from it."""
    padding_mask: Tensor | None = None
    """``[B, S_local]``: this rank's slice of the batch's ``attention_mask`` (the batch's tensor), ``None``
    when the batch has none."""
    batch_padded: Tensor | None = field(default=None, repr=False)
    """0-d bool on the batch's device: whether the whole batch's ``attention_mask`` masks a token, computed
    by :func:`shard_batch` before the split (read only by :meth:`masks_tokens`); ``None`` without one."""
    _state: _BatchState = field(default_factory=_BatchState, repr=False)

    @classmethod
    def build(cls, split: CPSplit, lengths: Tensor, device: torch.device | str) -> CPShard:
        """The shard of sequences of (unpadded) ``lengths`` ``[n]`` for ``split``, tensors on ``device``.

        Computed on the CPU from ``lengths`` (no device synchronization), then copied to ``device``;
        :attr:`position_ids` is ``None`` (:func:`shard_batch` gives the shard its batch's).
        """
        sequence, offset, local_lengths = split.positions(lengths.to("cpu", torch.int64))
        return cls(
            split=split,
            chunk_lengths=local_lengths // 2,
            cu_seqlens=boundaries(local_lengths).to(device),
            sequence_index=sequence.to(device),
            token_offset=offset.to(device),
        )

    def cached(self, build: Callable[..., T], *args: Hashable) -> T:
        """``build(self, *args)``, computed on the first call for ``build`` and ``args`` and kept for the batch,
        so that every layer (and a checkpointed layer's recomputation) reuses it: how a kernel derives what it
        needs from the shard (its key selection, orders, index copies) without the shard knowing the kernel.
        Local, no communication (``build`` must not communicate: ranks may reach it in another order)."""
        key = (build, args)
        derived = self._state.derived
        if key not in derived:
            derived[key] = build(self, *args)
        return derived[key]

    def sequence_order(self) -> Tensor:
        """``[cp * T_local]`` int64 on :attr:`cu_seqlens`' device: the row, among every rank's local tokens in
        rank order, of each token of the whole sequences in sequence order
        (:meth:`CPSplit.sequence_order <lightning_cp.parallel.split.CPSplit.sequence_order>`); built once per
        batch (:meth:`cached`)."""
        return self.cached(_sequence_order)

    def device_index(self, index: Tensor) -> Tensor:
        """``index``, a small integer index on the CPU (the heads or channels a rank takes), on
        :attr:`cu_seqlens`' device: copied once per batch for its values (:meth:`cached`), so the layers of a
        batch that ask for the same index share one copy (a host-to-device copy per layer would hold up the
        device's stream every time)."""
        return self.cached(_on_device, index.dtype, tuple(index.shape), tuple(index.flatten().tolist()))

    def masks_tokens(self, mask: Tensor) -> bool:
        """Whether ``mask``, a padding mask (1 on tokens, 0 on padding) a model was called with under this
        shard, masks any token of the batch: the same answer on every rank of the CP group for the batch's
        own ``attention_mask``.

        Right padding puts the zeros in the last chunk, which one rank holds: a check of each rank's slice
        would raise on that rank only while the others went on to their first collective. So for
        :attr:`padding_mask`, or a tensor of the same values (``transformers`` converts it to bool), the
        answer is the whole batch's, recorded by :func:`shard_batch` before the split; for any other mask,
        whether it has a zero on this rank. Local, no communication (one read of a device flag).
        """
        batch = self.padding_mask
        of_the_batch = (
            batch is not None
            and mask.shape == batch.shape
            and (mask is batch or torch.equal(mask.bool(), batch.bool()))
        )
        return bool(self.batch_padded) if of_the_batch else not bool(mask.all())

    @property
    def sequence_lengths(self) -> Tensor:
        """``[n]`` int64 on the CPU: each sequence's length padded to its ``2 * cp`` chunks, the lengths the
        sequences have in sequence order (:meth:`sequence_order`)."""
        return 2 * self.split.cp_size * self.chunk_lengths

    def group_exchange(self) -> GroupExchange:
        """:attr:`exchange`, the shard's CP group, which layers that reach their peers use (and so
        :attr:`reached_peers`).

        Raises:
            ValueError: the shard is one of a split over several ranks but was built without its group.
        """
        self._state.reached = True
        if self.exchange is not None:
            return self.exchange
        if self.split.cp_size > 1:
            raise ValueError(
                f"This cp_shard splits the batch over {self.split.cp_size} CP ranks but carries no CP group: "
                "shard the batch with shard_batch(batch, cp, cp_rank, cp_group=layout.cp_group) (as "
                "MegatronCPStrategy does), so that attention reaches the other ranks' tokens."
            )
        return GroupExchange()

    @property
    def reached_peers(self) -> bool:
        """Whether a layer reached the other ranks through this shard (:meth:`group_exchange`): CP attention
        and the token mixers do at every call under CP. A model whose layers never did attended within
        each rank's own tokens; the strategies refuse its training step."""
        return self._state.reached

    @property
    def num_sequences(self) -> int:
        return len(self.chunk_lengths)

    @property
    def local_tokens(self) -> int:
        """``T_local``: this rank's tokens of the batch (all rows)."""
        return 2 * int(self.chunk_lengths.sum())


def _sequence_order(shard: CPShard) -> Tensor:
    order = shard.split.sequence_order(shard.chunk_lengths)
    return order.to(shard.cu_seqlens.device, non_blocking=True)


def _on_device(shard: CPShard, dtype: torch.dtype, shape: tuple[int, ...], values: tuple[int, ...]) -> Tensor:
    index = torch.tensor(values, dtype=dtype).view(shape)
    return index.to(shard.cu_seqlens.device, non_blocking=True)
