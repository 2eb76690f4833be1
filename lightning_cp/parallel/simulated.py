"""Every rank of a CP group in one process: CP attention through the ``GroupExchange`` seam, without peers.

:class:`~lightning_cp.parallel.attention.GroupExchange` is the only way CP attention reaches its peers
(an all-gather of K/V in the forward and the backward, a reduce-scatter of their gradients). A
:class:`SimulatedCPGroup` stands in for the collectives of a group of ``cp`` ranks whose local K/V it
holds, so one process can run any rank's attention exactly as that rank would:

- ``all_gather`` returns every rank's K/V in rank order (a new tensor, as the collective allocates), the
  calling rank's part taken from its own argument;
- ``reduce_scatter`` keeps what the calling rank's backward sends to itself, and records the whole
  buffer; once every rank has run its backward, :meth:`SimulatedCPGroup.key_gradients` is each rank's
  sum over all ranks, which is what the real reduce-scatter returns.

:func:`simulate_cp_attention` runs every rank's forward and backward this way and reassembles the full
sequence: ``lightning-cp doctor`` checks it against full-sequence SDPA. ``benchmarks/attention.py`` times
one rank with an exchange that records nothing (``keep_key_gradients=False``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_cp.parallel.attention import GroupExchange, _CPAttention
from lightning_cp.parallel.sharding import shard_batch, unshard


class SimulatedCPGroup:
    """A CP group of ``len(local_kv)`` simulated ranks, for their attention in one process.

    Args:
        local_kv: every rank's K/V in rank order, each ``[T_local, 2 * Hkv, D]`` (keys then values along
            dim 1, token-major: what CP attention hands its exchange, see :func:`exchange_input`).
        keep_key_gradients: record what each rank's backward sends, for :meth:`key_gradients`. ``False``
            for timing one rank: the buffer is then freed as after a real reduce-scatter.
    """

    def __init__(self, local_kv: Sequence[Tensor], *, keep_key_gradients: bool = True) -> None:
        if not local_kv or len({tuple(kv.shape) for kv in local_kv}) != 1:
            shapes = [tuple(kv.shape) for kv in local_kv]
            raise ValueError(
                f"SimulatedCPGroup needs one K/V tensor of the same shape per rank, got {shapes}."
            )
        self._local_kv = list(local_kv)
        self._keep = keep_key_gradients
        self._sent: list[Tensor | None] = [None] * len(local_kv)

    @property
    def cp_size(self) -> int:
        return len(self._local_kv)

    def exchange(self, rank: int) -> GroupExchange:
        """Rank ``rank``'s exchange with the other simulated ranks (no communication)."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank={rank} must be in [0, cp_size={self.cp_size}).")
        return _SimulatedExchange(self, rank)

    def key_gradients(self, rank: int) -> Tensor:
        """``[T_local, 2 * Hkv, D]``: the K/V gradients of rank ``rank``'s tokens, summed over what every
        rank's backward sent (the real reduce-scatter's result).

        Raises:
            RuntimeError: a rank has not run its backward yet, or the group keeps no gradients.
        """
        missing = [r for r, sent in enumerate(self._sent) if sent is None]
        if missing:
            raise RuntimeError(
                f"key_gradients({rank}): simulated ranks {missing} have not sent their key gradients; run every "
                "rank's backward first (with keep_key_gradients=True)."
            )
        rows = self._local_kv[0].shape[0]
        return torch.stack([sent[rank * rows : (rank + 1) * rows] for sent in self._sent]).sum(0)


class _SimulatedExchange(GroupExchange):
    """One rank's view of a :class:`SimulatedCPGroup`."""

    def __init__(self, group: SimulatedCPGroup, rank: int) -> None:
        super().__init__(None)
        self._group = group
        self._rank = rank

    def all_gather(self, local: Tensor) -> Tensor:
        peers = self._group._local_kv
        if local.shape != peers[self._rank].shape:
            raise ValueError(
                f"simulated rank {self._rank} gathers a {tuple(local.shape)} tensor, but the group holds "
                f"{tuple(peers[self._rank].shape)} per rank."
            )
        return torch.cat([local if r == self._rank else kv for r, kv in enumerate(peers)])

    def reduce_scatter(self, full: Tensor) -> Tensor:
        if self._group._keep:
            self._group._sent[self._rank] = full
        rows = full.shape[0] // self._group.cp_size
        return full[self._rank * rows : (self._rank + 1) * rows].clone()


def exchange_input(k: Tensor, v: Tensor) -> Tensor:
    """What CP attention all-gathers from token-major ``k``, ``v`` ``[T_local, Hkv, D]``: ``[T_local, 2 * Hkv, D]``."""
    return torch.cat([k, v], dim=1)


def simulate_cp_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad_out: Tensor,
    *,
    cp_size: int,
    cu_seqlens: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CP attention of every rank of a simulated group of ``cp_size``, forward and backward, reassembled.

    The full batch is sharded with :func:`~lightning_cp.parallel.shard_batch` for every rank; each rank's
    queries attend through :class:`SimulatedCPGroup` exchanges (the K/V of all ranks; key gradients summed
    over all ranks), then :func:`~lightning_cp.parallel.unshard` puts every result back in sequence order.

    Args:
        q: ``[B, Hq, S, D]``: the queries of whole sequences (padded: ``B`` rows; packed: ``B = 1``).
        k, v: ``[B, Hkv, S, D]``, ``Hkv`` dividing ``Hq``.
        grad_out: ``[B, Hq, S, D]``: the gradient of the attention output.
        cp_size: the simulated CP group's size.
        cu_seqlens: packed documents' boundaries ``[n + 1]`` (``B`` must be 1); ``None``: one sequence per row.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``(out, dq, dk, dv)``, each of its input's shape and dtype: what context-parallel attention over a
        real group of ``cp_size`` ranks computes, gathered in sequence order. No communication.
    """
    batch_size, _, seq_len, dim = q.shape
    kv_heads = k.shape[1]
    scale = dim**-0.5 if scale is None else float(scale)
    batch = {"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.long, device=q.device)}
    batch.update({name: t.transpose(1, 2) for name, t in zip("qkvg", (q, k, v, grad_out))})  # [B, S, H, D]
    if cu_seqlens is not None:
        batch["cu_seqlens"] = cu_seqlens
    shards = [shard_batch(batch, cp_size, rank) for rank in range(cp_size)]

    def tokens(shard: dict, name: str) -> Tensor:  # [B, S_local, H, D] -> [B * S_local, H, D]
        return shard[name].flatten(0, 1).contiguous()

    leaves = [[tokens(s, name).requires_grad_() for name in "qkv"] for s in shards]
    group = SimulatedCPGroup([exchange_input(lk.detach(), lv.detach()) for _, lk, lv in leaves])
    outs, dqs = [], []
    for rank, (shard, (lq, lk, lv)) in enumerate(zip(shards, leaves)):
        out = _CPAttention.apply(lq, lk, lv, shard["cp_shard"], group.exchange(rank), scale)
        (dq,) = torch.autograd.grad(out, lq, tokens(shard, "g"))
        outs.append(out.detach())
        dqs.append(dq)
    dkvs = [group.key_gradients(rank) for rank in range(cp_size)]
    local_len = shards[0]["input_ids"].shape[1]

    def full(per_rank: list[Tensor]) -> Tensor:  # every rank's [B * S_local, H, D] -> [B, H, S, D]
        pieces = [t.unflatten(0, (batch_size, local_len)) for t in per_rank]
        seq = None if cu_seqlens is not None else seq_len
        return unshard(pieces, seq_len=seq, cu_seqlens=cu_seqlens).transpose(1, 2)

    dks, dvs = [kv[:, :kv_heads] for kv in dkvs], [kv[:, kv_heads:] for kv in dkvs]
    return full(outs), full(dqs), full(dks), full(dvs)
