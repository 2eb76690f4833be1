"""``MegatronCPStrategy``: DDP over data-parallel x context-parallel ranks, with Megatron-core's groups."""

from __future__ import annotations

import inspect
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

from lightning_cp.hf.check import check_attention_is_context_parallel
from lightning_cp.parallel import groups
from lightning_cp.parallel.batch_context import set_current_batch
from lightning_cp.parallel.layout import (
    ParallelLayout,
    check_size,
    data_parallel_size,
    set_current_layout,
)
from lightning_cp.parallel.sharding import shard_batch

# Keywords the strategy passes on: DDPStrategy's own, then DistributedDataParallel's. The strategy sets
# `module`, `device_ids` and the group itself.
_DDP_STRATEGY_KEYWORDS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_DDP_KEYWORDS = tuple(
    name
    for name in inspect.signature(DistributedDataParallel.__init__).parameters
    if name not in ("self", "module", "device_ids", "process_group", "device_mesh")
)


def _check_ddp_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
    for reserved in ("process_group", "device_mesh"):
        # LightningCLI may fill a DDP keyword with its default (None); only a real value conflicts.
        if kwargs.pop(reserved, None) is not None:
            raise ValueError(
                f"MegatronCPStrategy({reserved}=...): the strategy gives DDP the DP x CP group itself; remove it."
            )
    unknown = sorted(set(kwargs) - set(_DDP_STRATEGY_KEYWORDS) - set(_DDP_KEYWORDS))
    if unknown:
        raise TypeError(
            f"MegatronCPStrategy got unexpected keyword argument(s) {unknown}. It takes cp, tp, the arguments "
            f"of DDPStrategy and these DistributedDataParallel options: {', '.join(_DDP_KEYWORDS)}."
        )
    return kwargs


class MegatronCPStrategy(DDPStrategy):
    """Context-parallel (and tensor-parallel) training with Megatron-core process groups.

    ``Trainer(strategy=MegatronCPStrategy(cp=4))`` trains the same model on the same data as DDP,
    with every sequence split over ``cp`` ranks:

    - initializes the process group (NCCL on CUDA, gloo on CPU) and Megatron-core ``parallel_state``
      with ``tensor_model_parallel_size=tp`` and ``context_parallel_size=cp``; the remaining factor of the
      world size is data parallelism (``dp = world_size / (tp * cp)``). The result is :attr:`layout`,
      which is also :func:`lightning_cp.parallel.current_layout` while the strategy is set up;
    - the distributed sampler splits data over DP ranks only, so CP and TP peers see the same samples;
    - every train / val / test / predict batch is sharded for this CP rank by
      :func:`lightning_cp.parallel.shard_batch` after it reaches the device: the step methods receive
      next-token ``labels``, ``loss_mask``, ``position_ids``, ``shard_layout`` and, for packed batches,
      local ``cu_seqlens``; the shard is also recorded
      (:func:`lightning_cp.parallel.batch_context.current_batch`) for attention that cannot receive it,
      such as Hugging Face models built with ``attn_implementation="lightning_cp"``;
    - under ``cp > 1``, ``setup`` refuses attention layers that would see only the local shard
      (:func:`lightning_cp.hf.check_attention_is_context_parallel`);
    - gradients are averaged over DP x CP (DDP on ``layout.loss_group``): with the loss normalized as
      :class:`lightning_cp.CPLossMixin` does, the update equals a single process on the global batch;
    - parameters that are not tensor-parallel shards are broadcast within the TP group before DDP
      broadcasts over DP x CP, so every replica starts from the same weights.

    Args:
        cp: context-parallel size (ranks that share one sequence).
        tp: tensor-parallel size (ranks that share one layer's weights).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for :class:`~lightning.pytorch.strategies.DDPStrategy`.
        **kwargs: ``DDPStrategy``'s communication-hook options and
            :class:`~torch.nn.parallel.DistributedDataParallel` options (``find_unused_parameters``, ...).

    Raises:
        TypeError: ``cp`` or ``tp`` is not an integer, or an unknown keyword argument.
        ValueError: ``cp`` or ``tp`` < 1, or the world size is not divisible by ``tp * cp`` (raised when
            the Trainer is built, before any process is launched or collective is run).
        ValueError: at setup, under ``cp > 1``, a model with attention that is not context-parallel.

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
        self.cp = check_size("cp", cp, "MegatronCPStrategy")
        self.tp = check_size("tp", tp, "MegatronCPStrategy")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **_check_ddp_keywords(kwargs),
        )
        self._layout: ParallelLayout | None = None

    @property
    def layout(self) -> ParallelLayout:
        """This rank's DP x CP x TP layout and groups; available once the processes are set up."""
        if self._layout is None:
            raise RuntimeError(
                "Accessing MegatronCPStrategy.layout before the processes have initialized is not allowed: "
                "use it in the LightningModule's hooks (configure_model, the step methods), not in __init__."
            )
        return self._layout

    @property
    def dp(self) -> int:
        """Data-parallel size: ``world_size / (tp * cp)``."""
        return self._data_parallel_size()

    def _data_parallel_size(self) -> int:
        world = self.num_nodes * self.num_processes
        try:
            return data_parallel_size(world, self.cp, self.tp)
        except ValueError as error:
            raise ValueError(
                f"MegatronCPStrategy: num_nodes={self.num_nodes} x devices={self.num_processes}: {error}"
            ) from None

    @override
    def _configure_launcher(self) -> None:
        self._data_parallel_size()
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        self._data_parallel_size()
        super().setup_distributed()
        self._layout = groups.initialize(tp=self.tp, cp=self.cp)
        set_current_layout(self._layout)
        if self.root_device.type == "cuda":
            # The seed Lightning used (reset_seed above re-applies PL_GLOBAL_SEED when seed_everything ran).
            groups.seed_model_parallel_cuda_rng(torch.initial_seed())

    @override
    def setup(self, trainer: Any) -> None:
        check_attention_is_context_parallel(self.lightning_module, self.layout.cp)
        super().setup(trainer)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.dp, "rank": self.layout.dp_rank}

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        self._broadcast_within_tp(model)
        # Lightning's own construction (side CUDA stream, device ids), over the DP x CP ranks only.
        self._ddp_kwargs["process_group"] = groups.replica_group()
        return super()._setup_model(model)

    def _broadcast_within_tp(self, model: Module) -> None:
        """TP peers are not in DDP's group: give them the replicated (non-sharded) weights of TP rank 0."""
        group = self.layout.tp_group
        if group is None:
            return
        src = dist.get_global_rank(group, 0)
        for tensor in [*model.parameters(), *model.buffers()]:
            if not getattr(tensor, "tensor_model_parallel", False):
                dist.broadcast(tensor.data, src=src, group=group)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch (user transfer hooks see the full batch), then keep this CP rank's shard."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        batch = shard_batch(batch, self.layout.cp, self.layout.cp_rank)
        set_current_batch(batch)  # for attention that cannot receive it (Hugging Face models)
        return batch

    @override
    def teardown(self) -> None:
        super().teardown()
        set_current_batch(None)
        set_current_layout(None)
        self._layout = None
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
