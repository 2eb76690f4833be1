"""The head-parallel exchange: this rank's tokens of every head <-> every token of some heads, in sequence order.

A token mixer that is not softmax attention (a Gated DeltaNet, a Mamba2 scan, a short convolution) carries
a state or a window along the whole sequence, but does the same work independently for every head (or
channel). Under context parallelism each rank holds two chunks of every sequence (``shard_batch``'s
head-tail split); the exchange here gives each rank *every* token of the sequences for a slice of the
heads instead, so the mixer's own kernels run on whole sequences, unchanged, with no state passed between
ranks and no halo:

- :func:`to_heads`: ``[T_local, H, d]`` (this rank's tokens, all heads) -> ``[T_seq, h, d]`` (every token,
  the heads this rank takes), sequence after sequence in sequence order, each padded to its ``2 * cp`` chunks
  (the padding ``shard_batch`` added sits at the end of each sequence, where a causal mixer never reads it);
- :func:`to_tokens`: the inverse, ``[T_seq, H / cp, d]`` -> ``[T_local, H, d]``;
- :func:`for_each_sequence`: runs a mixer on each sequence alone (sequences of equal length together, as a
  batch), so that the state of one packed document never flows into the next.

Several tensors go in one all-to-all (:func:`to_heads` takes them all), so a layer exchanges once each way in
the forward and once each way in the backward, whatever it sends. The heads each rank takes may overlap
(Gated DeltaNet's key heads or Mamba2's B/C groups when there are fewer than ``cp``: each rank gets the ones
its value heads read), and the gradients of a head sent to several ranks are summed where it came from.

Communication per call: one all-to-all over the shard's CP group of ``T_local * sum(h_i * d_i) * cp`` elements
(forward), the same in the backward; none without CP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.layout import heads_split
from lightning_cp.parallel.offsets import starts
from lightning_cp.parallel.shard import CPShard
from lightning_cp.parallel.split import CPSplit


def head_slices(heads: int, cp: int, name: str = "heads") -> Tensor:
    """``[cp, heads / cp]`` int64: rank ``r`` takes the contiguous heads ``r * heads / cp .. (r + 1) * heads / cp``.

    Raises:
        ValueError: ``heads`` is not a multiple of ``cp`` (naming ``name`` and both numbers).
    """
    if heads % cp:
        raise ValueError(f"{name}={heads} is not divisible by cp={cp}")
    return torch.arange(heads).view(cp, heads // cp)


def shared_heads(slices: Tensor, readers: int, shared: int, name: str = "shared heads") -> Tensor:
    """``[cp, k]`` int64: the heads of a smaller set (``shared``: key heads, B/C groups) that each rank's
    ``slices`` (``[cp, h]``, of ``readers`` heads) read, head ``i`` reading shared head ``i // (readers /
    shared)`` (blocks of consecutive heads share one, as ``repeat_interleave`` does). With fewer shared heads
    than ranks, a shared head goes to several ranks.

    Raises:
        ValueError: the rank's heads do not cover whole shared heads nor lie inside one (``shared`` neither
            a multiple of ``cp`` nor a divisor of it), naming the numbers.
    """
    cp = slices.shape[0]
    if not heads_split(readers, shared, cp):
        raise ValueError(
            f"{name}={shared} for {readers} heads: each of cp={cp} ranks must take whole {name} or share one, so "
            f"{name} must divide the heads and be a multiple or a divisor of cp"
        )
    read = torch.div(slices, readers // shared, rounding_mode="floor")
    return torch.stack([torch.unique_consecutive(row) for row in read])


def to_heads(shard: CPShard, *tensors: tuple[Tensor, Tensor]) -> list[Tensor]:
    """Every token of the sequences, of the heads this rank takes, for each ``(x, heads)`` of ``tensors``.

    Args:
        shard: the batch's shard (its CP group, and where each rank's tokens sit in the sequences).
        *tensors: ``(x, heads)`` pairs: ``x`` ``[T_local, H, d]``, this rank's tokens (token-major, the rows
            of the batch flattened), of any dtype (a layer's fp32 decay beside its bf16 values); ``heads``
            ``[cp, h]`` int64 (CPU), the heads of ``x`` each rank takes (:func:`head_slices`,
            :func:`shared_heads`); copied to the device once per batch (:meth:`CPShard.device_index
            <lightning_cp.parallel.CPShard.device_index>`).

    Returns:
        One ``[T_seq, h, d]`` per pair, of its dtype: the sequences of the batch one after the other in
        sequence order, each padded to ``2 * cp`` chunks (``T_seq = cp * T_local``).

    Communication: one all-to-all over the shard's CP group, forward and backward, of every pair at once.
    """
    exchange, order = shard.group_exchange(), shard.sequence_order()
    cp, local = exchange.size, tensors[0][0].shape[0]
    sends = []
    for x, heads in tensors:
        if heads.shape[0] != cp or x.shape[0] != local:
            raise ValueError(
                f"to_heads: heads {tuple(heads.shape)} must have a row per rank of cp={cp}, and x "
                f"{tuple(x.shape)} the shard's {local} local tokens"
            )
        picked = x.index_select(1, shard.device_index(heads.flatten()))  # [T_local, cp * h, d]
        sends.append(picked.view(local, cp, -1).transpose(0, 1))  # [cp, T_local, h * d]
    received = _AllToAll.apply(exchange, *sends)  # each [cp, T_local, h * d]: row r from rank r
    return [
        part.flatten(0, 1).index_select(0, order).unflatten(1, (heads.shape[1], x.shape[2]))
        for part, (x, heads) in zip(received, tensors, strict=True)
    ]


def to_tokens(shard: CPShard, y: Tensor) -> Tensor:
    """The inverse of :func:`to_heads` with :func:`head_slices`: ``y`` ``[T_seq, H / cp, d]`` (every token of
    this rank's contiguous heads, in sequence order) -> ``[T_local, H, d]`` (this rank's tokens, every head in
    order).

    Communication: one all-to-all over the shard's CP group, forward and backward.
    """
    exchange, order = shard.group_exchange(), shard.sequence_order()
    cp = exchange.size
    heads, dim = y.shape[1], y.shape[2]
    rank_major = torch.empty_like(y).flatten(1).index_copy(0, order, y.flatten(1))  # [cp * T_local, h * d]
    (received,) = _AllToAll.apply(exchange, rank_major.view(cp, -1, heads * dim))  # [cp, T_local, h * d]
    return received.transpose(0, 1).reshape(-1, cp * heads, dim)


def for_each_sequence(
    shard: CPShard, function: Callable[..., Tensor | Sequence[Tensor]], *tensors: Tensor
) -> Tensor | list[Tensor]:
    """``function`` on each sequence of ``tensors`` alone: what :func:`to_heads` returns, ``[T_seq, ...]``.

    Sequences of the same (padded) length run together as a batch: ``function`` gets each tensor as
    ``[n, L, ...]`` (``n`` sequences of ``L`` tokens) and returns one ``[n, L, ...]`` tensor or a sequence of
    them; the results are put back in sequence order. A padded batch (rows of one length) is one call; a packed
    row, one call per distinct document length (the rows of each length built once per batch:
    :func:`sequences_by_length`). No state
    crosses a sequence boundary.
    """
    outputs: list[Tensor] = []
    single = True
    for length, rows in sequences_by_length(shard):  # rows [n * L]
        result = function(*(t.index_select(0, rows).unflatten(0, (-1, length)) for t in tensors))
        single = isinstance(result, Tensor)
        results = [result] if single else list(result)
        if not outputs:
            outputs = [r.new_empty((tensors[0].shape[0], *r.shape[2:])) for r in results]
        outputs = [out.index_copy(0, rows, r.flatten(0, 1)) for out, r in zip(outputs, results, strict=True)]
    return outputs[0] if single else outputs


class _AllToAll(torch.autograd.Function):
    """``GroupExchange.all_to_all`` of several ``[cp, T_local, w_i]`` tensors of any dtypes in one call (their
    bytes side by side), with its gradient: the same exchange of the incoming gradients."""

    @staticmethod
    def forward(ctx: Any, exchange: GroupExchange, *sends: Tensor) -> tuple[Tensor, ...]:
        ctx.exchange = exchange
        return _exchange_bytes(exchange, sends)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        return None, *_exchange_bytes(ctx.exchange, grads)


def _exchange_bytes(exchange: GroupExchange, tensors: Sequence[Tensor]) -> tuple[Tensor, ...]:
    if len(tensors) == 1:
        return (exchange.all_to_all(tensors[0]),)
    cp, local = tensors[0].shape[:2]
    as_bytes = [t.contiguous().view(torch.uint8).view(cp, local, -1) for t in tensors]
    received = exchange.all_to_all(torch.cat(as_bytes, dim=-1))
    parts = received.split([b.shape[-1] for b in as_bytes], dim=-1)
    return tuple(part.contiguous().view(t.dtype) for part, t in zip(parts, tensors, strict=True))


def sequences_by_length(shard: CPShard) -> list[tuple[int, Tensor]]:
    """``(L, rows)`` for each distinct padded sequence length ``L`` of ``shard`` (its ``sequence_lengths``), in
    order of first appearance: ``rows`` ``[n * L]`` int64 on the shard's device, the positions of those ``n``
    sequences' tokens in sequence order (:meth:`CPShard.sequence_order`), sequence after sequence. Built on the
    CPU once per batch (:meth:`CPShard.cached`)."""
    return shard.cached(_sequences_by_length)


def _sequences_by_length(shard: CPShard) -> list[tuple[int, Tensor]]:
    lengths = shard.sequence_lengths
    first_rows = starts(lengths)
    groups = []
    for length in dict.fromkeys(lengths.tolist()):
        first = first_rows[lengths == length]
        rows = (first[:, None] + torch.arange(length)).flatten()
        groups.append((length, rows.to(shard.cu_seqlens.device, non_blocking=True)))
    return groups


def whole_sequences(shard: CPShard) -> CPShard:
    """The shard of one rank holding every sequence of ``shard`` whole (cp = 1), each padded to its ``2 * cp``
    chunks: the tokens :func:`to_heads` gives a rank, in that order, as one packed row. Once per batch
    (:meth:`CPShard.cached`)."""
    return shard.cached(_whole_sequences)


def _whole_sequences(shard: CPShard) -> CPShard:
    return CPShard.build(CPSplit(1, 0), shard.sequence_lengths, shard.cu_seqlens.device)
