"""The gradient norm of a model whose tensor-parallel ranks each hold a shard of some parameters.

Megatron marks a tensor-parallel shard with ``tensor_model_parallel = True`` (a vocabulary-parallel head, a
column- or row-parallel linear); the other parameters are replicated on every TP rank. The model's gradient
norm counts each shard once and each replicated parameter once:
``|g|^2 = |g_replicated|^2 + sum over the TP group of |g_shard|^2``. ``torch.nn.utils.clip_grad_norm_`` on one
TP rank sees its own shard only, so each rank's norm is too small by the other shards' share: each clips by
another coefficient, too weakly, and the replicated parameters of the TP ranks drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_cp.parallel.layout import ProcessGroup


def is_tensor_parallel(parameter: Tensor) -> bool:
    """Whether ``parameter`` is this TP rank's shard of a larger tensor (Megatron's marking)."""
    return bool(getattr(parameter, "tensor_model_parallel", False))


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, tp_group: ProcessGroup | None) -> Tensor:
    """Scale the gradients of ``parameters`` in place so that the whole model's norm is at most ``max_norm``.

    Args:
        parameters: this rank's parameters; tensor-parallel shards marked as :func:`is_tensor_parallel` says,
            the others the same on every rank of ``tp_group``. Gradients may be ``DTensor`` shards (FSDP),
            whose norms are those of the whole tensors.
        max_norm: the largest norm of the whole model's gradient, as ``torch.nn.utils.clip_grad_norm_``'s.
        tp_group: the tensor-parallel group; ``None`` (tp = 1): ``torch``'s own norm.

    Returns:
        The whole model's gradient norm before clipping (fp32 scalar), the same on every rank of ``tp_group``.

    Communication: one all-reduce of a scalar over ``tp_group`` (and FSDP's of the ``DTensor`` norms).
    """
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.zeros(())
    device = parameters[0].grad.device  # the collective's: a CUDA tensor under NCCL
    shards = [p.grad for p in parameters if is_tensor_parallel(p)]
    replicated = [p.grad for p in parameters if not is_tensor_parallel(p)]
    shard_squares = _squared_norm(shards, device)
    if tp_group is not None:
        dist.all_reduce(shard_squares, group=tp_group)
    total = (shard_squares + _squared_norm(replicated, device)).sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


def _squared_norm(grads: list[Tensor], device: torch.device) -> Tensor:
    """``sum |g|^2`` over ``grads`` in fp32 on ``device`` (whole tensors' norms for ``DTensor`` shards)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norm = torch.nn.utils.get_total_norm(grads)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return norm.to(device=device, dtype=torch.float32).square()
