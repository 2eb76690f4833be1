"""``MegatronCPStrategy``: DDP or FSDP2 over DP x CP ranks, with Megatron-core's groups."""

from __future__ import annotations

import inspect
import signal
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save
from lightning.fabric.strategies.model_parallel import _load_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_cp.hf.probe import check_models
from lightning_cp.parallel import groups
from lightning_cp.parallel.layout import (
    ParallelLayout,
    check_size,
    data_parallel_size,
    set_current_layout,
)
from lightning_cp.parallel.sharding import shard_batch
from lightning_cp.strategies import _fsdp
from lightning_cp.strategies._fsdp import ModuleSpec
from lightning_cp.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_cp.strategies.preemption import PreemptionCheckpoint, SigtermAgreement

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Keywords the strategy passes on: DDPStrategy's own, then DistributedDataParallel's. The strategy sets
# `module`, `device_ids` and the group itself.
_DDP_STRATEGY_KEYWORDS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_DDP_KEYWORDS = tuple(
    name
    for name in inspect.signature(DistributedDataParallel.__init__).parameters
    if name not in ("self", "module", "device_ids", "process_group", "device_mesh")
)


def _check_ddp_keywords(kwargs: dict[str, Any], fsdp: bool) -> dict[str, Any]:
    for reserved in ("process_group", "device_mesh"):
        # LightningCLI may fill a DDP keyword with its default (None); only a real value conflicts.
        if kwargs.pop(reserved, None) is not None:
            raise ValueError(
                f"MegatronCPStrategy({reserved}=...): the strategy gives DDP the DP x CP group itself; remove it."
            )
    unknown = sorted(set(kwargs) - set(_DDP_STRATEGY_KEYWORDS) - set(_DDP_KEYWORDS))
    if unknown:
        raise TypeError(
            f"MegatronCPStrategy got unexpected keyword argument(s) {unknown}. It takes cp, tp, fsdp, fsdp_wrap, "
            f"activation_checkpointing, the arguments of DDPStrategy and these DistributedDataParallel options: {', '.join(_DDP_KEYWORDS)}."
        )
    given = sorted(name for name, value in kwargs.items() if value is not None)
    if fsdp and given:
        raise ValueError(
            f"MegatronCPStrategy(fsdp=True) got DDP option(s) {given}, which FSDP does not use: remove them, "
            "or use fsdp=False."
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
      next-token ``labels``, ``loss_mask``, ``position_ids``, ``cp_shard`` (which the model passes to its
      attention) and, for packed batches, local ``cu_seqlens``. Step methods that take a
      ``dataloader_iter`` (whose batches Lightning never hands to the strategy) are refused at setup;
    - under ``cp > 1``, ``setup`` refuses attention layers that would see only the local shard
      (:func:`lightning_cp.hf.check_attention_is_context_parallel`);
    - gradients are averaged over DP x CP (DDP on ``layout.loss_group``): with the loss normalized as
      :class:`lightning_cp.CPLossMixin` does, the update equals a single process on the global batch;
    - parameters that are not tensor-parallel shards are broadcast within the TP group before DDP
      broadcasts over DP x CP, so every replica starts from the same weights;
    - a SIGTERM (preemption) stops every rank after the same step, within one step, and
      :class:`~lightning_cp.strategies.preemption.PreemptionCheckpoint` saves that step as ``last.ckpt``
      (Lightning's own handler hangs there: see :mod:`lightning_cp.strategies.preemption`);
    - checkpoint files are written atomically (:class:`~lightning_cp.strategies.checkpoint_io.AtomicCheckpointIO`
      unless ``checkpoint_io`` is given): a full disk or a kill never leaves a truncated ``.ckpt``;
    - with ``fsdp=True``, FSDP2 (``fully_shard``) replaces DDP: parameters, gradients and optimizer state
      are sharded over the same DP x CP ranks (ZeRO-3; see ``lightning_cp/strategies/_fsdp.py``), mixed
      precision follows ``Trainer(precision=...)`` (``bf16-mixed``: fp32 master weights and optimizer
      state, bf16 compute, fp32 gradient reduce-scatter), and checkpoints are sharded
      ``torch.distributed.checkpoint`` folders that each rank writes its part of (see
      :func:`consolidate_checkpoint`).

    :attr:`device_mesh` is a ``DeviceMesh`` with dimensions ``("dp", "cp", "tp")`` over the same ranks.

    Args:
        cp: context-parallel size (ranks that share one sequence).
        tp: tensor-parallel size (ranks that share one layer's weights).
        fsdp: shard with FSDP2 over DP x CP instead of replicating with DDP. Needs ``tp=1``.
        fsdp_wrap: the modules that become FSDP units (gathered one at a time), as classes or class names.
            Default: the Hugging Face model's ``_no_split_modules``, the package GPT's blocks, else none
            (the whole model is one unit).
        activation_checkpointing: modules (classes or class names) whose activations are recomputed in
            backward (non-reentrant), with DDP or FSDP. Default: none.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for :class:`~lightning.pytorch.strategies.DDPStrategy`.
        **kwargs: ``DDPStrategy``'s communication-hook options and
            :class:`~torch.nn.parallel.DistributedDataParallel` options (``find_unused_parameters``, ...).

    Raises:
        TypeError: ``cp`` or ``tp`` is not an integer, an unknown keyword argument, or ``fsdp_wrap`` /
            ``activation_checkpointing`` holds something that is neither a module class nor a name.
        ValueError: ``cp`` or ``tp`` < 1, ``fsdp=True`` with ``tp > 1`` or with DDP options, or the world
            size is not divisible by ``tp * cp`` (raised when the Trainer is built, before any process is
            launched or collective is run). At setup: a ``fsdp_wrap`` / ``activation_checkpointing`` entry
            that matches no module, a precision FSDP does not support, a step method that takes a
            ``dataloader_iter``, or (``cp > 1``) a model with attention that is not context-parallel.

    Example::

        trainer = Trainer(accelerator="cpu", devices=4, strategy=MegatronCPStrategy(cp=2))  # dp=2 x cp=2
        trainer = Trainer(devices=8, precision="bf16-mixed", strategy=MegatronCPStrategy(cp=4, fsdp=True))
    """

    strategy_name = "megatron_cp"

    def __init__(
        self,
        cp: int = 1,
        tp: int = 1,
        fsdp: bool = False,
        fsdp_wrap: Sequence[ModuleSpec] | None = None,
        activation_checkpointing: Sequence[ModuleSpec] | None = None,
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
        if fsdp and self.tp > 1:
            raise ValueError(
                f"MegatronCPStrategy(fsdp=True, tp={tp}): FSDP does not support tensor parallelism here (the "
                "TP shards are not DTensors): use fsdp=True with tp=1, or DDP (fsdp=False) with tp > 1."
            )
        self.fsdp = bool(fsdp)
        self.fsdp_wrap = _fsdp.check_module_specs("fsdp_wrap", fsdp_wrap)
        self.activation_checkpointing = _fsdp.check_module_specs(
            "activation_checkpointing", activation_checkpointing
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **_check_ddp_keywords(kwargs, self.fsdp),
        )
        self._layout: ParallelLayout | None = None
        self._sigterm = SigtermAgreement()
        self._device_mesh: DeviceMesh | None = None

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
    def device_mesh(self) -> DeviceMesh:
        """The ``("dp", "cp", "tp")`` ``DeviceMesh`` over :attr:`layout`'s ranks; available after setup.

        For parallelism of your own in ``configure_model`` (as with Lightning's ``ModelParallelStrategy``):
        ``strategy.device_mesh["tp"]``, ``strategy.device_mesh["dp", "cp"]``. FSDP shards over the DP x CP
        ranks, ``device_mesh["dp", "cp"]`` flattened.
        """
        if self._device_mesh is None:
            raise RuntimeError(
                "Accessing MegatronCPStrategy.device_mesh before the processes have initialized is not "
                "allowed: use it in the LightningModule's hooks (configure_model, the step methods)."
            )
        return self._device_mesh

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
        self._device_mesh = _fsdp.device_mesh(self._layout, self.root_device.type)
        if self.root_device.type == "cuda":
            # The seed Lightning used (reset_seed above re-applies PL_GLOBAL_SEED when seed_everything ran).
            groups.seed_model_parallel_cuda_rng(torch.initial_seed())

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.layout.dp, "rank": self.layout.dp_rank}

    @override
    def setup(self, trainer: Trainer) -> None:
        assert isinstance(self.model, LightningModule)
        _check_steps_take_batches(self.model)
        check_models(self.model, self.layout, self.root_device)
        if not any(isinstance(callback, PreemptionCheckpoint) for callback in trainer.callbacks):
            trainer.callbacks.append(PreemptionCheckpoint())
        if self.activation_checkpointing:
            _fsdp.apply_checkpointing(
                self.model,
                _fsdp.resolve_classes("activation_checkpointing", self.activation_checkpointing, self.model),
            )
        if not self.fsdp:
            super().setup(trainer)
            return
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        wrap = self.fsdp_wrap if self.fsdp_wrap is not None else _fsdp.default_wrap(self.model)
        units = _fsdp.resolve_classes("fsdp_wrap", wrap, self.model)
        policy = _fsdp.mixed_precision_policy(str(self.precision_plugin.precision))
        # As DDP does at construction: every replica starts from DP x CP rank 0's weights. Sharded also
        # for evaluation, so that sharded checkpoints load into it.
        _broadcast_from_first(self.model.parameters(), groups.replica_group())
        self.model = _fsdp.shard(self.model, _fsdp.sharding_mesh(self.root_device.type), units, policy)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

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
        tensors = [*model.parameters(), *model.buffers()]
        _broadcast_from_first([t for t in tensors if not getattr(t, "tensor_model_parallel", False)], group)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch (user transfer hooks see the full batch), then keep this CP rank's shard."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return shard_batch(batch, self.layout.cp, self.layout.cp_rank)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded states load into the sharded model and optimizer.
        return self.fsdp

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self.fsdp

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state; with FSDP this rank's shards (``DTensor``), nothing gathered."""
        if not self.fsdp:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state; with FSDP this rank's shards, keyed by parameter name."""
        if not self.fsdp:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.lightning_module, optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """With FSDP: a folder written by ``torch.distributed.checkpoint``, each rank its own shards.

        The model and optimizer states go to the DCP files (``state_dict``, ``optimizer_0``, ...), the rest
        of the checkpoint (loops, callbacks, hyperparameters) to ``meta.pt`` from rank 0.
        """
        if not self.fsdp:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                "MegatronCPStrategy(fsdp=True).save_checkpoint(..., storage_options=...) is not supported: "
                "sharded checkpoints are written by torch.distributed.checkpoint, not the CheckpointIO."
            )
        path = Path(self.broadcast(filepath))
        if self.global_rank == 0 and path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        states = {"state_dict": checkpoint.pop("state_dict")}
        for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
            states[f"optimizer_{index}"] = state
        _distributed_checkpoint_save(states, path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """With FSDP: load a sharded folder (resharded by DCP if the layout differs) or a consolidated file.

        The model and optimizer states go straight into the sharded model and optimizers; the rest of the
        checkpoint is returned for Lightning to restore.
        """
        if not self.fsdp:
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(checkpoint_path))
        state: dict[str, Any] = {"state_dict": self.lightning_module}
        state.update({f"optimizer_{index}": optimizer for index, optimizer in enumerate(self.optimizers)})
        return _load_checkpoint(
            path=path,
            state=state,
            strict=self.lightning_module.strict_loading,
            optimizer_states_from_list=True,
            weights_only=weights_only,
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self.fsdp:  # with FSDP, load_checkpoint has loaded it
            super().load_model_state_dict(checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.fsdp:  # with FSDP, load_checkpoint has loaded it
            super().load_optimizer_state_dict(checkpoint)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._install_sigterm_handler()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._install_sigterm_handler()

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._install_sigterm_handler()

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(*args, **kwargs)
        self._stop_after_this_step_on_sigterm()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        output = super().validation_step(*args, **kwargs)
        self._stop_after_this_step_on_sigterm()
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        output = super().test_step(*args, **kwargs)
        self._stop_after_this_step_on_sigterm()
        return output

    def _install_sigterm_handler(self) -> None:
        # The handler Lightning replaced when the run started (the user's own, if any) keeps being called.
        original = self.lightning_module.trainer._signal_connector._original_handlers.get(signal.SIGTERM)
        self._sigterm.install(self.launcher, previous=original)

    def _stop_after_this_step_on_sigterm(self) -> None:
        """If any rank got SIGTERM, make Lightning's loops stop every rank at the end of this step."""
        if self._sigterm.agree(self.root_device):
            self.lightning_module.trainer._signal_connector.received_sigterm = True

    @override
    def teardown(self) -> None:
        if self.fsdp and self.lightning_module is not None:
            self.model = self.lightning_module  # the sharded module, without the root wrapper
        super().teardown()
        set_current_layout(None)
        self._layout = None
        self._device_mesh = None
        groups.destroy()
        if self.fsdp:
            # DTensor caches sharding decisions by mesh *layout*, which a later setup's new mesh (new
            # groups, same ranks) would compare equal to: forget the ones of the destroyed groups.
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Megatron-core context parallelism (cp / tp init args) over DDP or FSDP2 (fsdp=True)",
        )


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


def _broadcast_from_first(tensors: Any, group: dist.ProcessGroup) -> None:
    """Overwrite ``tensors`` in place with those of ``group``'s first rank (one broadcast per tensor)."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    for tensor in tensors:
        dist.broadcast(tensor.data, src=src, group=group)


def consolidate_checkpoint(folder: _PATH, output_file: _PATH) -> None:
    """Turn a sharded ``MegatronCPStrategy(fsdp=True)`` checkpoint folder into one ordinary checkpoint file.

    Runs in one process, without a process group, and needs the whole model and optimizer state in CPU
    memory. The weights load like any Lightning checkpoint's (``GPTModule.load_from_checkpoint(output_file)``,
    ``torch.load``); ``Trainer.fit(..., ckpt_path=output_file)`` with ``fsdp=True`` resumes from it (the
    optimizer state is keyed by parameter name, as ``torch.distributed.checkpoint`` keeps it).

    Example::

        python -c "from lightning_cp.strategies import consolidate_checkpoint as c; c('last.ckpt', 'last.pt')"
    """
    checkpoint = _load_distributed_checkpoint(Path(folder))
    optimizers = sorted(
        (key for key in checkpoint if key.startswith("optimizer_")), key=lambda k: int(k[10:])
    )
    checkpoint["optimizer_states"] = [checkpoint.pop(key) for key in optimizers]
    torch.save(checkpoint, output_file)


if MegatronCPStrategy.strategy_name not in StrategyRegistry:
    MegatronCPStrategy.register_strategies(StrategyRegistry)
