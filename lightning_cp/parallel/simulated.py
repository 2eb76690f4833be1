"""Every rank of a CP group in one process: CP attention through the ``GroupExchange`` seam, without peers.

:class:`~lightning_cp.parallel.exchange.GroupExchange` is the only way CP attention reaches its peers:
an all-gather of the local keys and values in the forward and the backward, a reduce-scatter of their
gradients. A :class:`SimulatedCPGroup` stands in for those collectives for ``cp`` ranks run one after the
other in this process. It learns what each rank sends by watching it: inside :meth:`SimulatedCPGroup.recording`
every exchange records its argument and answers with stand-ins of the right size; once every rank has been
recorded, the exchanges answer exactly as the collectives would (the all-gather: every rank's tensor in
rank order; the reduce-scatter: the sum over all ranks of their contributions to the calling rank; the
all-to-all of the head-parallel exchange: row ``r`` of what rank ``r`` sent). So the simulation never
depends on how the attention packs what it exchanges. Each collective answers with the last call every rank
recorded: exact for one exchange per pass (one attention or mixer layer); through a model of several layers
it stands in for the peers with the right shapes, which is what a memory or time measurement of one rank
needs.

:func:`simulate_cp_attention` runs every rank this way (a recording forward and backward, then the exact
ones) and reassembles the full sequence: ``lightning-cp doctor`` checks it against full-sequence SDPA.
``benchmarks/attention.py`` times one rank, its peers recorded once (``sum_key_gradients=False``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_cp.parallel._allgather_attention import AllGatherAttention
from lightning_cp.parallel._key_selection import shard_keys
from lightning_cp.parallel.exchange import GroupExchange
from lightning_cp.parallel.shard import CPShard
from lightning_cp.parallel.sharding import shard_batch, unshard


class SimulatedCPGroup:
    """The collectives of a CP group of ``cp_size`` ranks that all run in this process, one after the other.

    Use: run every rank's attention once inside :meth:`recording` (which records what each rank
    all-gathers and, in a backward, reduce-scatters), then again outside it for exact results.

    Args:
        cp_size: the number of simulated ranks.
        sum_key_gradients: outside :meth:`recording`, a reduce-scatter returns the sum of what every rank
            sent in the recorded backward (exact). ``False`` keeps the calling rank's own share instead,
            without recording, when one rank is timed and the others never run a backward.
    """

    def __init__(self, cp_size: int, *, sum_key_gradients: bool = True) -> None:
        if cp_size < 1:
            raise ValueError(f"cp_size={cp_size} must be >= 1.")
        self._gathered: list[Tensor | None] = [None] * cp_size
        self._sent: list[Tensor | None] = [None] * cp_size
        self._sent_rows: list[Tensor | None] = [None] * cp_size
        self._sum = sum_key_gradients
        self._recording = False

    @property
    def cp_size(self) -> int:
        return len(self._gathered)

    def exchange(self, rank: int) -> GroupExchange:
        """Rank ``rank``'s exchange with the other simulated ranks (no communication)."""
        if not 0 <= rank < self.cp_size:
            raise ValueError(f"rank={rank} must be in [0, cp_size={self.cp_size}).")
        return _SimulatedExchange(self, rank)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record what every exchange sends. Meanwhile an all-gather has zeros for the ranks not recorded
        yet, and a reduce-scatter returns the calling rank's own share: results are not exact here."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def _missing(self, recorded: list[Tensor | None], what: str) -> None:
        missing = [rank for rank, t in enumerate(recorded) if t is None]
        if missing:
            raise RuntimeError(
                f"simulated CP ranks {missing} have not {what} yet: run every rank once inside "
                "SimulatedCPGroup.recording() first (the forward, and the backward for key gradients)."
            )


class _SimulatedExchange(GroupExchange):
    """One rank's view of a :class:`SimulatedCPGroup`."""

    def __init__(self, group: SimulatedCPGroup, rank: int) -> None:
        super().__init__(None)
        self._group = group
        self._rank = rank

    @property
    def size(self) -> int:
        return self._group.cp_size

    @property
    def rank(self) -> int:
        return self._rank

    def all_gather(self, local: Tensor) -> Tensor:
        group = self._group
        group._gathered[self._rank] = local.detach()
        if not group._recording:
            group._missing(group._gathered, "all-gathered")
        peers = [t if t is not None else torch.zeros_like(local) for t in group._gathered]
        return torch.cat([local if r == self._rank else t for r, t in enumerate(peers)])

    def all_to_all(self, send: Tensor) -> Tensor:
        group = self._group
        group._sent_rows[self._rank] = send.detach()
        if not group._recording:
            group._missing(group._sent_rows, "sent their all-to-all rows")
        peers = [t if t is not None else torch.zeros_like(send) for t in group._sent_rows]
        return torch.stack(
            [send[self._rank] if r == self._rank else t[self._rank] for r, t in enumerate(peers)]
        )

    def reduce_scatter(self, full: Tensor) -> Tensor:
        group, rank = self._group, self._rank
        rows = full.shape[0] // group.cp_size
        if group._recording:
            group._sent[rank] = full.detach()
        elif group._sum:
            group._missing(group._sent, "sent their key gradients")
            return torch.stack([sent[rank * rows : (rank + 1) * rows] for sent in group._sent]).sum(0)
        return full[rank * rows : (rank + 1) * rows].clone()


def rank_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    shard: CPShard,
    scale: float,
    *,
    window: int | None = None,
) -> Tensor:
    """One CP rank's attention with its peers behind the shard's exchange, as ``context_parallel_attention``
    runs it.

    Args:
        q: ``[T_local, Hq, D]``, the rank's queries token-major (``[B, Hq, S_local, D]`` with ``B`` and
            ``S_local`` flattened).
        k, v: ``[T_local, Hkv, D]``.
        shard: the rank's ``CPShard`` of the batch, carrying how it reaches its peers (a
            :class:`SimulatedCPGroup`'s exchange, given to ``shard_batch(..., cp_group=...)``).
        scale: softmax scale.
        window: sliding window in tokens (``None``: causal over the whole sequence).

    Returns:
        ``[T_local, Hq, D]``, differentiable w.r.t. ``q``, ``k``, ``v``.
    """
    keys, exchange = shard_keys(shard, window), shard.group_exchange()
    return AllGatherAttention.apply(q, k, v, None, keys, exchange, scale, None, k.shape[1])


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
    attention runs through a :class:`SimulatedCPGroup` (recorded first, then exact), and
    :func:`~lightning_cp.parallel.unshard` puts every result back in sequence order.

    Args:
        q: ``[B, Hq, S, D]``: the queries of whole sequences (padded: ``B`` rows; packed: ``B = 1``).
        k, v: ``[B, Hkv, S, D]``, ``Hkv`` dividing ``Hq``.
        grad_out: ``[B, Hq, S, D]``: the gradient of the attention output.
        cp_size: the simulated CP group's size.
        cu_seqlens: packed documents' boundaries ``[n + 1]`` (``B`` must be 1); ``None``: one sequence per row.
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``(out, dq, dk, dv)``, each of its input's shape and dtype: what context-parallel attention over a
        real group of ``cp_size`` ranks computes, gathered in sequence order. No communication; every
        rank's forward and backward run twice (recording, then exact).
    """
    batch_size, _, seq_len, dim = q.shape
    scale = dim**-0.5 if scale is None else float(scale)
    batch = {"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.long, device=q.device)}
    batch.update({name: t.transpose(1, 2) for name, t in zip("qkvg", (q, k, v, grad_out))})  # [B, S, H, D]
    if cu_seqlens is not None:
        batch["cu_seqlens"] = cu_seqlens
    group = SimulatedCPGroup(cp_size)
    shards = [shard_batch(batch, cp_size, rank, cp_group=group.exchange(rank)) for rank in range(cp_size)]

    def tokens(shard: dict, name: str) -> Tensor:  # [B, S_local, H, D] -> [B * S_local, H, D]
        return shard[name].flatten(0, 1).contiguous()

    leaves = [tuple(tokens(s, name).requires_grad_() for name in "qkv") for s in shards]
    grads_out = [tokens(s, "g") for s in shards]

    def forward(rank: int) -> Tensor:
        return rank_attention(*leaves[rank], shards[rank]["cp_shard"], scale)

    with group.recording(), torch.no_grad():
        for rank in range(cp_size):
            forward(rank)
    outs = [forward(rank) for rank in range(cp_size)]
    with group.recording():
        for rank in range(cp_size):
            torch.autograd.grad(outs[rank], leaves[rank], grads_out[rank], retain_graph=True)
    grads = [torch.autograd.grad(outs[rank], leaves[rank], grads_out[rank]) for rank in range(cp_size)]
    local_len = shards[0]["input_ids"].shape[1]

    def full(per_rank: list[Tensor]) -> Tensor:  # every rank's [B * S_local, H, D] -> [B, H, S, D]
        pieces = [t.detach().unflatten(0, (batch_size, local_len)) for t in per_rank]
        seq = None if cu_seqlens is not None else seq_len
        return unshard(pieces, seq_len=seq, cu_seqlens=cu_seqlens).transpose(1, 2)

    dq, dk, dv = (full([g[i] for g in grads]) for i in range(3))
    return full(outs), dq, dk, dv
