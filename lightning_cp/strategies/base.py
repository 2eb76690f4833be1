"""What both of the package's strategies do, whatever wraps the model: groups, layout, sampling, sharding.

:class:`MegatronCPBase` holds it; :class:`~lightning_cp.MegatronCPStrategy` adds DDP and
:class:`~lightning_cp.MegatronCPFSDPStrategy` FSDP2, both over the DP x CP ranks. It subclasses Lightning's
``DDPStrategy`` for the launcher and the process-group setup, which both modes use unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from typing_extensions import override

from lightning_cp.checkpoint_format import FROZEN_BASE, check_partial_state
from lightning_cp.constants import CP_SHARD
from lightning_cp.memory.offload import ActivationOffload
from lightning_cp.parallel import groups
from lightning_cp.parallel.attention_mode import AttentionKind, AttentionMode
from lightning_cp.parallel.broadcast import broadcast_tensors
from lightning_cp.parallel.grad_norm import clip_grad_norm_
from lightning_cp.parallel.layout import (
    ParallelLayout,
    ProcessGroup,
    check_size,
    data_parallel_size,
    set_current_layout,
)
from lightning_cp.parallel.shard import CPShard
from lightning_cp.parallel.sharding import shard_batch
from lightning_cp.strategies._modules import (
    ModuleSpec,
    apply_checkpointing,
    check_module_specs,
    resolve_classes,
)
from lightning_cp.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_cp.strategies.epoch_position import resume_inside_the_epoch
from lightning_cp.strategies.global_batch import GlobalBatchRecord
from lightning_cp.strategies.integrations import integrations
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
      ``dataloader_iter`` (whose batches Lightning never hands to the strategy) are refused at setup, and
      under ``cp > 1`` a training step in which no layer reached the other ranks through the batch's
      ``cp_shard`` (a model that never gave its attention the shard) is refused after its forward;
    - refuse at ``setup`` any model whose training under this layout could differ from the unsharded
      model's, and make its models refuse a call on a batch's shard that would attend within the shard,
      through the model integrations registered with the strategies
      (:mod:`lightning_cp.strategies.integrations`; the package registers ``transformers``'
      :mod:`lightning_cp.hf.integration`: attention that would see only the local shard, other token
      mixing, length-dependent positions, output transforms the loss would not apply);
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
            inputs) in host memory, copied back ahead of need (:func:`lightning_cp.memory.offload_checkpointed`);
            a number ``N``: the first ``N`` checkpointed modules' only, the later ones' staying on the device
            (``lightning-cp plan``'s ``+offload:N``, where host memory is the bound). Needs
            ``activation_checkpointing``.
        cp_attention: how attention reaches the other CP ranks' tokens: ``"allgather"`` (every rank keeps its
            queries and all-gathers the key/value heads, in rounds; any head counts), ``"ulysses"`` (an
            all-to-all to every token of ``Hq / cp`` query heads and the key/value heads they read: each rank
            holds the whole sequences' K/V of those heads only; the heads must split over ``cp``) or
            ``"auto"`` (Ulysses where the heads split, else the all-gather). The numbers are the same either
            way. See :mod:`lightning_cp.parallel.attention_mode`.
        kv_heads_per_gather: with the all-gather, the key/value heads gathered per round, rounded down to a
            divisor of the model's ``Hkv`` (the whole sequence's K/V transient falls with it; the numbers do
            not change); ``None``: on CUDA as many as fit a quarter of the least free device memory of the
            CP group (agreed once per batch), all at once on the CPU. Refused with ``"ulysses"``.
        accelerator: the device type (default: the Trainer's ``accelerator``).
        parallel_devices: the devices of this node's ranks (default: from the Trainer's ``devices``).
        cluster_environment: where each rank's rank, the world size and the main address come from
            (default: detected: SLURM, torchrun, ..., else Lightning's launcher).
        checkpoint_io: how checkpoint files are written; default
            :class:`~lightning_cp.strategies.checkpoint_io.AtomicCheckpointIO`.
        precision_plugin: the numeric precision (default: the Trainer's ``precision``).
        process_group_backend: ``"nccl"`` on CUDA and ``"gloo"`` on the CPU unless given.
        timeout: how long a collective waits for the other ranks before it fails.
        start_method: how the ranks are started: ``"popen"`` runs the command again once per device (as
            ``DDPStrategy`` does), the others are ``multiprocessing`` start methods.
        **kwargs: options of the wrapper, which each subclass checks (:meth:`_wrapper_options`):
            ``MegatronCPStrategy`` takes ``DDPStrategy``'s communication-hook options and
            :class:`~torch.nn.parallel.DistributedDataParallel`'s (``find_unused_parameters``, ...).

    Raises:
        TypeError: ``cp`` or ``tp`` is not an integer, an option the wrapper does not take, or
            ``activation_checkpointing`` holds something that is neither a module class nor a name.
        ValueError: ``cp`` or ``tp`` < 1, an unknown ``cp_attention``, ``kv_heads_per_gather`` < 1 or
            given with ``cp_attention="ulysses"``, ``offload_activations`` without
            ``activation_checkpointing``, or the world size is not divisible by ``tp * cp`` (raised when the
            Trainer is built, before any process is launched or collective is run). At setup: an
            ``activation_checkpointing`` entry that matches no module, or (``cp > 1``) a model that CP cannot
            train exactly. At the first training step (``cp > 1``): no layer reached the other ranks through
            the batch's ``cp_shard``.
    """

    strategy_name: str
    """The name a ``Trainer(strategy=...)`` string selects the subclass by."""

    def __init__(
        self,
        cp: int = 1,
        tp: int = 1,
        activation_checkpointing: Sequence[ModuleSpec] | None = None,
        offload_activations: bool | int = False,
        cp_attention: AttentionKind = "allgather",
        kv_heads_per_gather: int | None = None,
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
        owner = type(self).__name__
        options = self._wrapper_options(kwargs)
        self.cp = check_size("cp", cp, owner)
        self.tp = check_size("tp", tp, owner)
        self.activation_checkpointing = check_module_specs(
            owner, "activation_checkpointing", activation_checkpointing
        )
        if not isinstance(offload_activations, bool) and (
            not isinstance(offload_activations, int) or offload_activations < 1
        ):
            raise ValueError(
                f"{owner}(offload_activations={offload_activations!r}): use True (every checkpointed module's "
                "inputs), False, or a positive number of checkpointed modules whose inputs go to the host."
            )
        if offload_activations and not self.activation_checkpointing:
            raise ValueError(
                f"{owner}(offload_activations={offload_activations!r}) offloads what checkpointed modules keep for "
                "their backward, "
                "but activation_checkpointing is not set: name the layers to recompute, e.g. "
                'activation_checkpointing=["LlamaDecoderLayer"], or remove offload_activations.'
            )
        self.offload_activations = offload_activations
        try:
            self.attention_mode = AttentionMode(cp_attention, kv_heads_per_gather)
        except ValueError as error:
            raise ValueError(f"{owner}: {error}") from None
        self._activation_offload: ActivationOffload | None = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **options,
        )
        self._layout: ParallelLayout | None = None
        self._device_mesh: DeviceMesh | None = None

    @classmethod
    def _wrapper_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments beyond the shared ones, checked: what goes on to ``DDPStrategy``."""
        raise NotImplementedError

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
        for integration in integrations():
            integration.check(self.model, self.layout)
            integration.prepare(self.model, self.layout)
        self._probe_before_wrapping()
        if self.activation_checkpointing:
            owner = type(self).__name__
            classes = resolve_classes(
                owner, "activation_checkpointing", self.activation_checkpointing, self.model
            )
            self._activation_offload = apply_checkpointing(self.model, classes, self.offload_activations)

    def _probe_before_wrapping(self) -> None:
        """The integrations' behavioural probe of the whole models (DDP); FSDP probes after sharding."""
        for integration in integrations():
            if integration.holds_models(self.model):
                integration.probe(self.model, self.layout, self.root_device)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The ``LightningModule``'s whole weights (its ``state_dict``) on global rank 0, as CPU tensors;
        an empty dict on the other ranks. The way to get them from a callback (to save or publish a model,
        to evaluate a copy), or after ``fit`` returns (the trained weights): every rank must call it, as
        every rank runs a callback's hooks.

        Communication: none here (every rank holds the weights whole); under FSDP an all-gather of every
        parameter, one at a time.

        Raises:
            NotImplementedError: with ``tp > 1``, whose shards only the model knows how to put together.
        """
        if self.tp > 1:
            raise NotImplementedError(
                f"{type(self).__name__}(tp={self.tp}).full_state_dict(): the tensor-parallel shards are "
                "the model's own (Megatron-style splits); gather them as the model defines."
            )
        if self.global_rank != 0:
            return {}
        return {name: tensor.detach().cpu() for name, tensor in self.lightning_module.state_dict().items()}

    @override
    def setup_precision_plugin(self) -> None:
        """Lightning's, and under ``tp > 1`` gradient clipping by the whole model's norm: each tensor-parallel
        shard counted once over the TP group (:func:`lightning_cp.parallel.grad_norm.clip_grad_norm_`), where
        Lightning's ``clip_grad_norm_`` sees this TP rank's shards only."""
        super().setup_precision_plugin()
        if self.layout.tp > 1:
            _clip_over_tensor_parallel(self.precision_plugin, self.layout.tp_group)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint, a run stopped before the end of its epoch resuming inside that epoch
        (:func:`~lightning_cp.strategies.epoch_position.resume_inside_the_epoch`). One that holds only the
        parameters that train (a LoRA run's adapters, :data:`~lightning_cp.checkpoint_format.FROZEN_BASE`) is
        checked against the module's own frozen base first, before anything is loaded
        (:func:`~lightning_cp.checkpoint_format.check_partial_state`), and loads into those parameters only."""
        only = check_partial_state(checkpoint_path, self.lightning_module)
        checkpoint = self._read_checkpoint(checkpoint_path, weights_only, only)
        resume_inside_the_epoch(checkpoint)
        return checkpoint

    def _read_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None, only: set[str] | None
    ) -> dict[str, Any]:
        """The checkpoint file, read by the ``CheckpointIO`` (the FSDP strategy reads its shards, ``only``
        those tensors of the module when given)."""
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Lightning's, not strict for a checkpoint that holds only the parameters that train (checked in
        :meth:`load_checkpoint`: the frozen rest is the module's own)."""
        super().load_model_state_dict(checkpoint, strict=strict and FROZEN_BASE not in checkpoint)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The module's ``training_step``; under CP refused when no layer reached the other ranks through the
        batch's ``cp_shard`` (the model attended within each rank's own tokens)."""
        output = super().training_step(*args, **kwargs)
        batch = args[0] if args else kwargs.get("batch")
        _check_shard_reached(self.lightning_module, self.layout.cp, batch)
        return output

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move the batch (user transfer hooks see the full batch), then keep this CP rank's shard."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        layout = self.layout
        return shard_batch(
            batch, layout.cp, layout.cp_rank, cp_group=layout.cp_group, attention=self.attention_mode
        )

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
    """Overwrite ``tensors`` in place with those of ``group``'s first rank (one broadcast per tensor, a
    quantized weight's through its codes and scales: :func:`~lightning_cp.parallel.broadcast.broadcast_tensors`).

    Communication: a broadcast per tensor over ``group``; none when it is ``None`` (one rank).
    """
    if group is None:
        return
    broadcast_tensors(tensors, dist.get_global_rank(group, 0), group)


def _clip_over_tensor_parallel(plugin: Precision, tp_group: ProcessGroup | None) -> None:
    """Make ``plugin``'s norm clipping (``gradient_clip_val``) clip by the norm of every TP rank's shards."""

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
        clip_grad_norm_(plugin.main_params(optimizer), float(clip_val), tp_group)

    plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]


def _check_shard_reached(module: LightningModule | None, cp: int, batch: Any) -> None:
    """Refuse a training step under ``cp > 1`` whose batch's shard no layer used to reach the other ranks.

    The same verdict on every rank (every rank runs the same model on its shard), so every rank raises.
    """
    shard = batch.get(CP_SHARD) if isinstance(batch, Mapping) else None
    if cp == 1 or not isinstance(shard, CPShard) or shard.reached_peers:
        return
    raise ValueError(
        f"{type(module).__name__}.training_step ran under cp={cp} but no layer reached the other CP ranks "
        "through the batch's shard, so its attention saw only this rank's tokens (two chunks of every "
        'sequence) and training would be silently wrong: pass cp_shard=batch["cp_shard"] to the model and on '
        "to every attention layer (context_parallel_attention(q, k, v, cp_shard=cp_shard); a transformers "
        'model built with attn_implementation="lightning_cp" takes it as a keyword of its forward).'
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
