"""FSDP2 for :class:`~lightning_cp.MegatronCPFSDPStrategy`: the sharding mesh, the units, mixed precision.

The strategy shards parameters, gradients and optimizer state over the DP x CP ranks with PyTorch's
``fully_shard`` (ZeRO-3): CP peers hold different tokens of the same samples but the same weights, so they
belong to the sharding group exactly as they belong to DDP's reduction group. Each FSDP *unit* (a module
listed in ``fsdp_wrap``) all-gathers its parameters before its forward and backward and reduce-scatters
its gradients after; the parameters outside every unit form the root unit, a thin wrapper around the
``LightningModule`` whose forward is the step method (Lightning's forward redirection), so the root
gathers them once per step. Calls of the model outside the step: :mod:`lightning_cp.strategies._outside_step`.

With the strategy's ``cpu_offload`` every unit carries FSDP's ``CPUOffloadPolicy``: the shards of parameters
and gradients live in host memory (pinned on CUDA), each unit is copied to the device for its all-gather,
its gradient shards are copied back after its reduce-scatter, and the optimizer steps on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_cp.parallel.layout import ProcessGroup

T = TypeVar("T")

_PRECISIONS = {
    "32-true": MixedPrecisionPolicy(),
    # fp32 master weights and optimizer state (bf16-mixed) or bf16 ones (bf16-true); bf16 compute; the
    # gradients are reduce-scattered in fp32 either way.
    "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16-true": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def sharding_mesh(group: ProcessGroup, device_type: str) -> DeviceMesh:
    """The 1-D ``("dp_cp",)`` mesh FSDP shards over: ``group``, the layout's DP x CP ``loss_group``.

    Built on that existing group rather than with ``DeviceMesh._flatten`` of ``mesh["dp", "cp"]``, which
    would create one more process group with the same ranks.
    """
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp_cp",))


def full_tensor(shards: DTensor, mesh: DeviceMesh | None = None) -> torch.Tensor:
    """The whole tensor of a parameter's ``shards`` on every rank, on the device of ``mesh``'s type.

    ``mesh``: a mesh over the same ranks to gather over instead of the shards' own (whose group a teardown
    destroyed); ``None``: their own. Shards in host memory (``cpu_offload``, or moved there by Lightning's
    teardown) are copied to that device first, as the mesh's backend communicates there.

    Communication: an all-gather over the mesh.
    """
    mesh = mesh or shards.device_mesh
    local = shards.to_local().to(mesh.device_type)
    placed = DTensor.from_local(
        local, mesh, shards.placements, run_check=False, shape=shards.shape, stride=shards.stride()
    )
    return placed.full_tensor()


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP's policy for ``Trainer(precision=...)``; a ``ValueError`` for one FSDP does not support here."""
    policy = _PRECISIONS.get(precision)
    if policy is None:
        raise ValueError(
            f"MegatronCPFSDPStrategy does not support Trainer(precision={precision!r}): choose one of "
            f"{', '.join(_PRECISIONS)} (fp16 needs a sharded gradient scaler; use bf16-mixed instead)."
        )
    return policy


def offload_policy(cpu_offload: bool, device: torch.device) -> OffloadPolicy:
    """FSDP's offload policy for every unit: the shards in host memory with ``cpu_offload`` (pinned when the
    compute ``device`` is CUDA, so that the copies to and from it run asynchronously), else on ``device``."""
    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()


def to_device_except_parameters(module: nn.Module, device: torch.device) -> None:
    """Move what ``module.to(device)`` moves, except the parameters: every buffer (a rotary table, which no
    FSDP unit manages after setup), every module holding no parameter, whole (a ``torchmetrics`` metric's
    states), and the device a ``LightningModule`` reports (``self.device``, where its batches are). Under
    ``cpu_offload`` the parameters' shards stay in host memory; the computation needs the rest on the device.
    ``module.to`` itself would copy every shard to the device and back (FSDP re-pins them after ``_apply``).
    """
    if next(module.parameters(), None) is None:
        module.to(device)
        return
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.device != device:
            module._buffers[name] = buffer.to(device)
    if isinstance(module, _DeviceDtypeModuleMixin):
        module._device = device  # what its ``to(device)`` records
    for child in module.children():
        to_device_except_parameters(child, device)


def untied_token_embeddings(model: nn.Module) -> list[nn.Module]:
    """The token embeddings ``model``'s modules declare (``get_input_embeddings()``, the ``transformers``
    API) whose weight no other module shares: with the default units, each becomes a unit of its own.

    In the root unit, an embedding would stay gathered from the first forward to the end of the backward
    (for Llama-3-8B 1 GiB in bf16, for Llama-3-70B 2 GiB); as a unit it is gathered for its forward and
    again for its backward only. A tied embedding stays in the root: the head's weight is the same tensor,
    read by the loss.
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            owners[id(parameter)] = owners.get(id(parameter), 0) + 1
    found: list[nn.Module] = []
    for module in model.modules():
        getter = getattr(module, "get_input_embeddings", None)
        embedding = getter() if callable(getter) else None
        if (
            isinstance(embedding, nn.Module)
            and embedding not in found
            and all(owners[id(p)] == 1 for p in embedding.parameters())
        ):
            found.append(embedding)
    return found


class _Root(nn.Module):
    """The root FSDP unit: the LightningModule's parameters outside every unit.

    Lightning calls the step methods through the wrapper's ``forward`` (as it does for DDP), so FSDP's
    root hooks run once per step: they gather the root's parameters and finish the backward.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def shard(
    module: nn.Module,
    mesh: DeviceMesh,
    wrap: Sequence[type[nn.Module]],
    policy: MixedPrecisionPolicy,
    also: Sequence[nn.Module] = (),
    offload: OffloadPolicy | None = None,
) -> nn.Module:
    """``fully_shard`` ``module`` in place over the 1-D ``mesh``; return the root to train through.

    Modules of a ``wrap`` class, and the modules in ``also``, become FSDP units, innermost first; the rest
    of ``module`` becomes the root unit (:class:`_Root`), which must be what Lightning calls the step
    methods through. Every unit, the root included, takes the mixed-precision ``policy`` and the ``offload``
    policy (:func:`offload_policy`; default: none, the shards on the mesh's device).

    Communication: none here (each rank keeps its slice of its own weights, identical on every rank).
    """
    options = {"mesh": mesh, "mp_policy": policy, "offload_policy": offload or OffloadPolicy()}
    wrap_classes = tuple(wrap)
    for submodule in reversed(list(module.modules())):
        unit = (wrap_classes and isinstance(submodule, wrap_classes)) or any(submodule is m for m in also)
        if unit and submodule is not module:
            fully_shard(submodule, **options)
    root = _Root(module)
    fully_shard(root, **options)
    return root


def call_in_root(root: nn.Module, function: Callable[[], T]) -> T:
    """``function()`` run as the forward of ``root`` (a :func:`shard` result), so that FSDP's root hooks run
    around it: the first call initializes FSDP's state with ``root`` as its root (a call of an inner unit
    first would make that unit the root), and the root unit's parameters are gathered while it runs. Inner
    units gather their own when called. Lightning runs the step methods the same way. After it, every unit
    holds its shards again (FSDP's root keeps its parameters gathered after a forward, for the backward that
    follows one in training: an optimizer built next must see the sharded parameters).

    Communication: FSDP's all-gather of the root unit's parameters over its mesh.
    """
    inner = root.module
    inner.forward = lambda: function()  # an instance attribute, deleted after: the class's forward returns
    try:
        return root()
    finally:
        del inner.forward
        root.reshard()


def forget_meshes() -> None:
    """Forget what DTensor caches about meshes: its sharding decisions and redistribution planners are keyed by
    a mesh's *layout*, which the mesh of a later setup (new groups, the same ranks) compares equal to, so they
    would run collectives over destroyed groups ("Could not resolve the process group"). The strategy calls
    this at teardown and before it shards (a checkpoint saved after ``fit`` caches the torn-down mesh again).
    """
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
