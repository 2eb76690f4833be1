"""Autograd-aware collectives that work on gloo subgroups and on NCCL.

``torch.distributed.nn.functional.all_gather`` has a broken backward on gloo subgroups that do not
start at global rank 0, and gloo has no reduce-scatter; so the package uses its own all-gather whose
backward returns each rank the sum of the gradients of its own slice: a reduce-scatter on NCCL, an
all-reduce followed by taking the local slice on gloo (twice the traffic, same result).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_cp.parallel.groups import ProcessGroup


def _group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        group, dim = ctx.group, ctx.dim
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if dist.get_backend(group) == "nccl":
            parts = [p.contiguous() for p in grad.chunk(size, dim=dim)]
            out = torch.empty_like(parts[rank])
            dist.reduce_scatter(out, parts, group=group)
            return out, None, None
        grad = grad.contiguous()
        dist.all_reduce(grad, group=group)
        return grad.chunk(size, dim=dim)[rank].contiguous(), None, None


def all_gather(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order of ``group``; differentiable.

    Communication: one all-gather of ``x`` in forward; in backward one reduce-scatter (NCCL) or
    all-reduce (gloo) of the gradient, so each rank receives the summed gradient of its own slice.
    All ranks must pass tensors of the same shape. With a group of size 1 (or no process group)
    ``x`` is returned unchanged.
    """
    if _group_size(group) == 1:
        return x
    return _AllGather.apply(x, dim, group)
