"""``MegatronCPStrategy``: DDP over data-parallel x context-parallel ranks, with Megatron-core's groups."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_cp.parallel import groups
from lightning_cp.parallel.sharding import shard_batch


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"MegatronCPStrategy({name}={value!r}): {name} must be an integer >= 1, e.g. {name}=2."
        )
    if value < 1:
        raise ValueError(f"MegatronCPStrategy({name}={value}): {name} must be >= 1 (1 disables it).")
    return value


class MegatronCPStrategy(DDPStrategy):
    """Context-parallel (and tensor-parallel) training with Megatron-core process groups.

    ``Trainer(strategy=MegatronCPStrategy(cp=4))`` trains the same model on the same data as DDP,
    with every sequence split over ``cp`` ranks:

    - initializes the process group (NCCL on CUDA, gloo on CPU) and Megatron-core ``parallel_state``
      with ``tensor_model_parallel_size=tp`` and ``context_parallel_size=cp``; the remaining factor of the
      world size is data parallelism (``dp = world_size / (tp * cp)``);
    - the distributed sampler splits data over DP ranks only, so CP and TP peers see the same samples;
    - every train / val / test / predict batch is sharded for this CP rank by
      :func:`lightning_cp.parallel.shard_batch` after it reaches the device: the step methods receive
      next-token ``labels``, ``loss_mask``, ``position_ids`` and, for packed batches, local ``cu_seqlens``;
    - gradients are averaged over DP x CP (DDP on ``groups.dp_cp_group()``): with the loss normalized as
      :class:`lightning_cp.CPLossMixin` does, the update equals a single process on the global batch;
    - parameters that are not tensor-parallel shards are broadcast within the TP group before DDP
      broadcasts over DP x CP, so every replica starts from the same weights.

    Args:
        cp: context-parallel size (ranks that share one sequence).
        tp: tensor-parallel size (ranks that share one layer's weights).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for :class:`~lightning.pytorch.strategies.DDPStrategy`.
        **kwargs: passed to :class:`~torch.nn.parallel.DistributedDataParallel`.

    Raises:
        TypeError: ``cp`` or ``tp`` is not an integer.
        ValueError: ``cp`` or ``tp`` < 1, or the world size is not divisible by ``tp * cp`` (raised when
            the Trainer is built, before any process is launched or collective is run).

    Example::

        trainer = Trainer(accelerator="cpu", devices=4, strategy=MegatronCPStrategy(cp=2))  # dp=2 x cp=2
    """

    strategy_name = "megatron_cp"

    def __init__(
        self,
        cp: int = 1,
        tp: int = 1,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        self.cp = _check_size("cp", cp)
        self.tp = _check_size("tp", tp)
        for reserved in ("process_group", "device_mesh"):
            # LightningCLI fills every DDP keyword with its default (None here); only a real value conflicts.
            if kwargs.pop(reserved, None) is not None:
                raise ValueError(
                    f"MegatronCPStrategy({reserved}=...): the strategy gives DDP the DP x CP group itself; remove it."
                )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp(self) -> int:
        """Data-parallel size: ``world_size / (tp * cp)``."""
        return self._check_world_size()

    def _check_world_size(self) -> int:
        world = self.num_nodes * self.num_processes
        if world % (self.tp * self.cp):
            raise ValueError(
                f"MegatronCPStrategy: world size {world} (num_nodes={self.num_nodes} x devices={self.num_processes}) "
                f"is not divisible by tp({self.tp}) * cp({self.cp}) = {self.tp * self.cp}. "
                f"Use a device count that is a multiple of {self.tp * self.cp}, or change cp / tp."
            )
        return world // (self.tp * self.cp)

    @override
    def _configure_launcher(self) -> None:
        self._check_world_size()
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        self._check_world_size()
        super().setup_distributed()
        groups.initialize(tp=self.tp, cp=self.cp)
        if self.root_device.type == "cuda":
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(int(os.environ.get("PL_GLOBAL_SEED", 1234)))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if not groups.model_parallel_initialized():
            raise RuntimeError(
                "MegatronCPStrategy: the sampler layout is known only after the process groups are initialized."
            )
        return {"num_replicas": groups.dp_size(), "rank": groups.dp_rank()}

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        self._broadcast_within_tp(model)
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(
            module=model, device_ids=device_ids, process_group=groups.dp_cp_group(), **self._ddp_kwargs
        )

    def _broadcast_within_tp(self, model: Module) -> None:
        """TP peers are not in DDP's group: give them the replicated (non-sharded) weights of TP rank 0."""
        group = groups.tp_group()
        if groups.tp_size() == 1:
            return
        src = dist.get_global_rank(group, 0)
        for tensor in [*model.parameters(), *model.buffers()]:
            if not getattr(tensor, "tensor_model_parallel", False):
                dist.broadcast(tensor.data, src=src, group=group)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch (user transfer hooks see the full batch), then keep this CP rank's shard."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return shard_batch(batch, groups.cp_size(), groups.cp_rank())

    @override
    def teardown(self) -> None:
        super().teardown()
        groups.destroy()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Megatron-core context parallelism (cp / tp init args) over DDP",
        )


if MegatronCPStrategy.strategy_name not in StrategyRegistry:
    MegatronCPStrategy.register_strategies(StrategyRegistry)
