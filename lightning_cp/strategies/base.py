"""What both of the package's strategies do, whatever wraps the model: groups, layout, sampling, sharding.

:class:`MegatronCPBase` holds it; :class:`~lightning_cp.MegatronCPStrategy` adds DDP and
:class:`~lightning_cp.MegatronCPFSDPStrategy` FSDP2, both over the DP x CP ranks. It subclasses Lightning's
``DDPStrategy`` for the launcher and the process-group setup, which both modes use unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_cp.hf.attention import guard_sharded_calls
from lightning_cp.hf.probe import check_models
from lightning_cp.memory.offload import ActivationOffload
from lightning_cp.parallel import groups
from lightning_cp.parallel.layout import (
    ParallelLayout,
    ProcessGroup,
    check_size,
    data_parallel_size,
    set_current_layout,
)
from lightning_cp.parallel.sharding import shard_batch
from lightning_cp.strategies._modules import (
    ModuleSpec,
    apply_checkpointing,
    check_module_specs,
    resolve_classes,
)
from lightning_cp.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_cp.strategies.global_batch import GlobalBatchRecord
from lightning_cp.strategies.preemption import PreemptionCheckpoint, StopOnSigterm


class MegatronCPBase(StopOnSigterm, DDPStrategy):
    """Context-parallel (and tensor-parallel) training with Megatron-core process groups; subclasses wrap.

    Not used directly: :class:`~lightning_cp.MegatronCPStrategy` (DDP) and
    :class:`~lightning_cp.MegatronCPFSDPStrategy` (FSDP2) are its two wrapping modes. Both

    - initialize the process group (NCCL on CUDA, gloo on CPU) and Megatron-core ``parallel_state`` with
      ``tensor_model_parallel_size=tp`` and ``context_parallel_size=cp``; the remaining factor of the world
      size is data parallelism (``dp = world_size / (tp * cp)``). The result is :attr:`layout`, which is
      also :func:`lightning_cp.parallel.current_layout` while the strategy is set up, and
      :attr:`device_mesh`;
    - split the data over DP ranks only (the distributed sampler), so CP and TP peers see the same samples;
    - shard every train / val / test / predict batch for this CP rank with
      :func:`lightning_cp.parallel.shard_batch` after it reaches the device: the step methods receive
      next-token ``labels``, ``loss_mask``, ``position_ids``, ``cp_shard`` (which the model passes to its
      attention) and, for packed batches, local ``cu_seqlens``. Step methods that take a
      ``dataloader_iter`` (whose batches Lightning never hands to the strategy) are refused at setup;
    - refuse at ``setup`` any model whose training under this layout could differ from the unsharded
      model's (:func:`lightning_cp.hf.check_models`: attention that would see only the local shard, other
      token mixing, length-dependent positions, output transforms the loss would not apply), and make its
      ``transformers`` models refuse a call on a batch's shard without the batch's ``cp_shard``, and run a
      call with it without a KV cache unless ``use_cache`` is given
      (:func:`lightning_cp.hf.attention.guard_sharded_calls`);
    - recompute the ``activation_checkpointing`` modules' activations in backward and, with
      ``offload_activations``, keep their saved inputs in host memory until then
      (:attr:`activation_offload`);
    - stop every rank after the same step on a SIGTERM, within two steps
      (:class:`~lightning_cp.strategies.preemption.StopOnSigterm`), and save that step as ``last.ckpt``
      (:class:`~lightning_cp.strategies.preemption.PreemptionCheckpoint`, added to the callbacks);
    - keep the layout and the global batch in checkpoints, and say once how the global batch changes when a
      run resumes on another layout (:class:`~lightning_cp.strategies.global_batch.GlobalBatchRecord`,
      added to the callbacks);
    - write checkpoint files atomically (:class:`~lightning_cp.strategies.checkpoint_io.AtomicCheckpointIO`
      unless ``checkpoint_io`` is given).

    Args:
        cp: context-parallel size (ranks that share one sequence).
        tp: tensor-parallel size (ranks that share one layer's weights).
        activation_checkpointing: modules (classes or class names) whose activations are recomputed in
            backward (non-reentrant). Default: none.
        offload_activations: keep what the ``activation_checkpointing`` modules save for their backward (their
            inputs) in host memory, copied back ahead of need (:func:`lightning_cp.memory.offload_checkpointed`).
            Needs ``activation_checkpointing``.
        checkpoint_io: default :class:`~lightning_cp.strategies.checkpoint_io.AtomicCheckpointIO`.
        **kwargs: ``DDPStrategy``'s other arguments.
    """

    strategy_name: str
    """The name a ``Trainer(strategy=...)`` string selects the subclass by."""

    def __init__(
        self,
        cp: int,
        tp: int,
        activation_checkpointing: Sequence[ModuleSpec] | None,
        offload_activations: bool,
        checkpoint_io: CheckpointIO | None,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        self.cp = check_size("cp", cp, owner)
        self.tp = check_size("tp", tp, owner)
        self.activation_checkpointing = check_module_specs(
            owner, "activation_checkpointing", activation_checkpointing
        )
        if offload_activations and not self.activation_checkpointing:
            raise ValueError(
                f"{owner}(offload_activations=True) offloads what checkpointed modules keep for their backward, "
                "but activation_checkpointing is not set: name the layers to recompute, e.g. "
                'activation_checkpointing=["LlamaDecoderLayer"], or remove offload_activations.'
            )
        self.offload_activations = offload_activations
        self._activation_offload: ActivationOffload | None = None
        super().__init__(checkpoint_io=checkpoint_io or AtomicCheckpointIO(), **kwargs)
        self._layout: ParallelLayout | None = None
        self._device_mesh: DeviceMesh | None = None

    @property
    def layout(self) -> ParallelLayout:
        """This rank's DP x CP x TP layout and groups; available once the processes are set up."""
        if self._layout is None:
            raise RuntimeError(
                f"Accessing {type(self).__name__}.layout before the processes have initialized is not allowed: "
                "use it in the LightningModule's hooks (configure_model, the step methods), not in __init__."
            )
        return self._layout

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``("dp", "cp", "tp")`` ``DeviceMesh`` over :attr:`layout`'s ranks; available after setup.

        For parallelism of your own in ``configure_model`` (as with Lightning's ``ModelParallelStrategy``):
        ``strategy.device_mesh["tp"]``, ``strategy.device_mesh["dp", "cp"]``. Built on Megatron's groups:
        ranks sit where Megatron puts them, ``rank = tp_rank + tp * (cp_rank + cp * dp_rank)``, the
        row-major order of a ``[dp, cp, tp]`` tensor.
        """
        if self._device_mesh is None:
            raise RuntimeError(
                f"Accessing {type(self).__name__}.device_mesh before the processes have initialized is not "
                "allowed: use it in the LightningModule's hooks (configure_model, the step methods)."
            )
        return self._device_mesh

    @property
    def activation_offload(self) -> ActivationOffload | None:
        """With ``offload_activations``, what moves the checkpointed modules' inputs (its ``stats`` count the
        bytes) once the module is set up; else ``None``."""
        return self._activation_offload

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
                f"{type(self).__name__}: num_nodes={self.num_nodes} x devices={self.num_processes}: {error}"
            ) from None

    @override
    def _configure_launcher(self) -> None:
        self._data_parallel_size()
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # Before Lightning restores the callbacks' states from the checkpoint (DDP restores them before setup).
        trainer = self.lightning_module.trainer
        for callback_type in (PreemptionCheckpoint, GlobalBatchRecord):
            if not any(isinstance(callback, callback_type) for callback in trainer.callbacks):
                trainer.callbacks.append(callback_type())

    @override
    def setup_distributed(self) -> None:
        self._data_parallel_size()
        super().setup_distributed()
        self._layout = groups.initialize(tp=self.tp, cp=self.cp)
        set_current_layout(self._layout)
        ranks = torch.arange(self._layout.world_size).reshape(
            self._layout.dp, self._layout.cp, self._layout.tp
        )
        self._device_mesh = DeviceMesh.from_group(
            list(groups.mesh_groups()), self.root_device.type, mesh=ranks, mesh_dim_names=("dp", "cp", "tp")
        )
        if self.root_device.type == "cuda":
            # The seed Lightning used (reset_seed above re-applies PL_GLOBAL_SEED when seed_everything ran).
            groups.seed_model_parallel_cuda_rng(torch.initial_seed())

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.dp, "rank": self.layout.dp_rank}

    @override
    def setup(self, trainer: Trainer) -> None:
        self._prepare_module()
        super().setup(trainer)

    def _prepare_module(self) -> None:
        """What ``setup`` does before wrapping: the model checks, activation checkpointing."""
        assert isinstance(self.model, LightningModule)
        _check_steps_take_batches(self.model)
        self._check_models()
        if self.layout.cp > 1:
            guard_sharded_calls(self.model)
        if self.activation_checkpointing:
            owner = type(self).__name__
            classes = resolve_classes(
                owner, "activation_checkpointing", self.activation_checkpointing, self.model
            )
            self._activation_offload = apply_checkpointing(self.model, classes, self.offload_activations)

    def _check_models(self) -> None:
        """Refuse models CP cannot train exactly (:func:`lightning_cp.hf.check_models`), before wrapping."""
        check_models(self.model, self.layout, self.root_device)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch (user transfer hooks see the full batch), then keep this CP rank's shard."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return shard_batch(batch, self.layout.cp, self.layout.cp_rank, cp_group=self.layout.cp_group)

    @override
    def teardown(self) -> None:
        super().teardown()
        set_current_layout(None)
        self._layout = None
        self._device_mesh = None
        groups.destroy()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=(cls.__doc__ or "").split("\n")[0])


def broadcast_from_first(tensors: Iterable[torch.Tensor], group: ProcessGroup | None) -> None:
    """Overwrite ``tensors`` in place with those of ``group``'s first rank (one broadcast per tensor).

    Communication: a broadcast per tensor over ``group``; none when it is ``None`` (one rank).
    """
    if group is None:
        return
    src = dist.get_global_rank(group, 0)
    for tensor in tensors:
        dist.broadcast(tensor.data, src=src, group=group)


def _check_steps_take_batches(module: LightningModule) -> None:
    """Refuse step methods that take a ``dataloader_iter``: the strategy never sees their batches."""
    steps = ("training_step", "validation_step", "test_step", "predict_step")
    found = [s for s in steps if is_param_in_hook_signature(getattr(module, s), "dataloader_iter", True)]
    if found:
        raise ValueError(
            f"{type(module).__name__}.{found[0]}(self, dataloader_iter) gets batches that Lightning never "
            "hands to MegatronCPStrategy.batch_to_device, so they would not be sharded (every CP rank would "
            f"run the whole sequence, labels not shifted). Write {found[0]}(self, batch, batch_idx) instead."
        )
