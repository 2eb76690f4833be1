"""How the ranks of a CP group reach each other: :class:`GroupExchange`, the one seam of every CP collective.

A batch's :class:`~lightning_cp.parallel.CPShard` carries the exchange of the group it was split over
(``cp_shard.exchange``), so every layer that needs its peers (CP attention's K/V all-gather and gradient
reduce-scatter, the head-parallel exchange of token mixers) finds them on the shard it is given: no
process-wide lookup. Because nothing else talks
to the peers, one process can stand in for them (:class:`~lightning_cp.parallel.simulated.SimulatedCPGroup`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_cp.parallel.layout import ProcessGroup


class GroupExchange:
    """The collectives of a CP group over ``group`` (``None``: one rank, no communication).

    Args:
        group: the context-parallel process group (``strategy.layout.cp_group``), or ``None``.
    """

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group

    @property
    def size(self) -> int:
        """The number of ranks in the group (1 without one)."""
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's index in the group (0 without one)."""
        return 0 if self.group is None else dist.get_rank(self.group)

    def all_gather(self, local: Tensor) -> Tensor:
        """``[cp * T_local, ...]``: every rank's ``local`` ``[T_local, ...]``, in rank order."""
        if self.group is None:
            return local
        gathered = local.new_empty((dist.get_world_size(self.group) * local.shape[0], *local.shape[1:]))
        dist.all_gather_single(gathered, local.contiguous(), group=self.group)
        return gathered

    def reduce_scatter(self, full: Tensor) -> Tensor:
        """This rank's ``[T_local, ...]`` slice of the sum over ranks of ``full`` ``[cp * T_local, ...]``."""
        if self.group is None:
            return full
        size = dist.get_world_size(self.group)
        local = full.shape[0] // size
        if self._backend(full.device) == "nccl":
            out = full.new_empty((local, *full.shape[1:]))
            dist.reduce_scatter_single(out, full, group=self.group)
            return out
        # gloo has no reduce-scatter: all-reduce, then keep this rank's slice (twice the traffic).
        dist.all_reduce(full, group=self.group)
        rank = dist.get_rank(self.group)
        return full[rank * local : (rank + 1) * local].clone()

    def agree_min(self, value: int) -> int:
        """The least of every rank's ``value``: one all-reduce (MIN) of one int64 over the group, read back
        on the host (on the CPU where the group has a CPU backend, else on the current CUDA device). For a choice that sets how many
        collectives run (or how large they are), which every rank must make alike."""
        if self.group is None:
            return value
        cpu = torch.device("cpu")
        device = cpu if self._backend(cpu) is not None else torch.device("cuda", torch.cuda.current_device())
        agreed = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        return int(agreed.item())

    def _backend(self, device: torch.device) -> str | None:
        """The group's backend for tensors on ``device`` (``None``: none), read from its per-device map: a group
        may have one per device type (``cpu:gloo,cuda:nccl``, what ``cpu_offload`` creates), whose name as a
        whole is neither ``"nccl"`` nor ``"gloo"``."""
        backend = dist.Backend(str(dist.get_backend(self.group)))
        return dist.BackendConfig(backend).get_device_backend_map().get(device.type)

    def all_to_all(self, send: Tensor) -> Tensor:
        """``[cp, ...]`` whose row ``r`` is what rank ``r`` sent this rank: ``send`` ``[cp, ...]`` holds in
        row ``p`` what this rank sends rank ``p`` (every row of the same shape). Its own adjoint: the gradient
        of the result goes back through the same exchange."""
        if self.group is None:
            return send
        send = send.contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        return received
