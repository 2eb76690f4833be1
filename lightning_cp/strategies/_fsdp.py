"""FSDP2 for :class:`~lightning_cp.MegatronCPStrategy`: the device mesh, the units, mixed precision.

With ``fsdp=True`` the strategy shards parameters, gradients and optimizer state over the DP x CP ranks
with PyTorch's ``fully_shard`` (ZeRO-3): CP peers hold different tokens of the same samples but the same
weights, so they belong to the sharding group exactly as they belong to DDP's reduction group. Each FSDP
*unit* (a module listed in ``fsdp_wrap``) all-gathers its parameters before its forward and backward and
reduce-scatters its gradients after; the parameters outside every unit form the root unit, a thin wrapper
around the ``LightningModule`` whose forward is the step method (Lightning's forward redirection), so the
root gathers them once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_cp.models.gpt import _Block
from lightning_cp.parallel import groups
from lightning_cp.parallel.layout import ParallelLayout

ModuleSpec = str | type[nn.Module]
"""A module class, or its class name (``type(module).__name__``), e.g. ``"LlamaDecoderLayer"``."""

_PRECISIONS = {
    "32-true": MixedPrecisionPolicy(),
    # fp32 master weights and optimizer state (bf16-mixed) or bf16 ones (bf16-true); bf16 compute; the
    # gradients are reduce-scattered in fp32 either way.
    "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16-true": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def check_module_specs(argument: str, value: Sequence[ModuleSpec] | None) -> tuple[ModuleSpec, ...] | None:
    """``value`` as a tuple of class names / classes, or a ``TypeError`` naming ``argument``."""
    if value is None:
        return None
    if isinstance(value, (str, type)):
        value = [value]
    specs = tuple(value)
    for spec in specs:
        if not (isinstance(spec, str) or (isinstance(spec, type) and issubclass(spec, nn.Module))):
            raise TypeError(
                f"MegatronCPStrategy({argument}={value!r}): {spec!r} is neither a module class nor a class "
                'name; pass e.g. ["LlamaDecoderLayer"] or [torch.nn.TransformerEncoderLayer].'
            )
    return specs


def device_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """The ``("dp", "cp", "tp")`` mesh of the run, over Megatron's groups (no new process group).

    Ranks sit where Megatron puts them, ``rank = tp_rank + tp * (cp_rank + cp * dp_rank)``, which is the
    row-major order of a ``[dp, cp, tp]`` tensor.
    """
    ranks = torch.arange(layout.world_size).reshape(layout.dp, layout.cp, layout.tp)
    return DeviceMesh.from_group(
        list(groups.mesh_groups()), device_type, mesh=ranks, mesh_dim_names=("dp", "cp", "tp")
    )


def sharding_mesh(device_type: str) -> DeviceMesh:
    """The 1-D ``("dp_cp",)`` mesh FSDP shards over: the ranks of ``mesh["dp", "cp"]``, flattened.

    Built on Megatron's DP x CP group rather than with ``DeviceMesh._flatten``, which would create one more
    process group with the same ranks.
    """
    return DeviceMesh.from_group(groups.replica_group(), device_type, mesh_dim_names=("dp_cp",))


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """FSDP's policy for ``Trainer(precision=...)``; a ``ValueError`` for one FSDP does not support here."""
    policy = _PRECISIONS.get(precision)
    if policy is None:
        raise ValueError(
            f"MegatronCPStrategy(fsdp=True) does not support Trainer(precision={precision!r}): choose one of "
            f"{', '.join(_PRECISIONS)} (fp16 needs a sharded gradient scaler; use bf16-mixed instead)."
        )
    return policy


def default_wrap(model: nn.Module) -> tuple[ModuleSpec, ...]:
    """The units when ``fsdp_wrap`` is not given: Hugging Face's ``_no_split_modules``, the GPT's blocks.

    Empty when the model has neither: everything is then in the root unit.
    """
    names: list[ModuleSpec] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or ():
            if name not in names:
                names.append(name)
    if any(isinstance(module, _Block) for module in model.modules()):
        names.append(_Block)
    return tuple(names)


def resolve_classes(
    argument: str, specs: Sequence[ModuleSpec], model: nn.Module
) -> tuple[type[nn.Module], ...]:
    """The module classes ``specs`` names in ``model``; a ``ValueError`` for a spec that matches no module."""
    present = {type(module).__name__: type(module) for module in model.modules()}
    classes: list[type[nn.Module]] = []
    for spec in specs:
        if isinstance(spec, str):
            found = present.get(spec)
        else:
            found = spec if any(isinstance(module, spec) for module in model.modules()) else None
        if found is None:
            name = spec if isinstance(spec, str) else spec.__qualname__
            raise ValueError(
                f"MegatronCPStrategy({argument}=...): {name!r} matches no module of "
                f"{type(model).__name__}. Its module classes are: {', '.join(sorted(present))}."
            )
        classes.append(found)
    return tuple(classes)


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


def apply_checkpointing(module: nn.Module, classes: Sequence[type[nn.Module]]) -> None:
    """Recompute the activations of every submodule of one of ``classes`` in backward, in place.

    Non-reentrant (``torch.distributed._composable.checkpoint``): parameter names do not change, and it
    composes with ``fully_shard`` and DDP.
    """
    from torch.distributed._composable import checkpoint

    for submodule in module.modules():
        if isinstance(submodule, tuple(classes)):
            checkpoint(submodule)


def shard(
    module: nn.Module, mesh: DeviceMesh, wrap: Sequence[type[nn.Module]], policy: MixedPrecisionPolicy
) -> nn.Module:
    """``fully_shard`` ``module`` in place over the 1-D ``mesh``; return the root to train through.

    Modules of a ``wrap`` class become FSDP units, innermost first; the rest of ``module`` becomes the
    root unit (:class:`_Root`), which must be what Lightning calls the step methods through.

    Communication: none here (each rank keeps its slice of its own weights, identical on every rank).
    """
    wrap_classes = tuple(wrap)
    for submodule in reversed(list(module.modules())):
        if wrap_classes and isinstance(submodule, wrap_classes) and submodule is not module:
            fully_shard(submodule, mesh=mesh, mp_policy=policy)
    root = _Root(module)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    return root
