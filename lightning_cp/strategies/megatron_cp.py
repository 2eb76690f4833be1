"""``MegatronCPStrategy``: DDP over the DP x CP ranks, with Megatron-core's groups."""

from __future__ import annotations

import inspect
from abc import ABCMeta
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_cp.strategies._modules import ModuleSpec
from lightning_cp.strategies.base import MegatronCPBase, broadcast_from_first
from lightning_cp.strategies.megatron_cp_fsdp import MegatronCPFSDPStrategy

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
            f"MegatronCPStrategy got unexpected keyword argument(s) {unknown}. It takes cp, tp, fsdp, fsdp_wrap, "
            f"activation_checkpointing, offload_activations, the arguments of DDPStrategy and these DistributedDataParallel options: {', '.join(_DDP_KEYWORDS)}."
        )
    return kwargs


class _FSDPSwitch(ABCMeta):
    """``MegatronCPStrategy(..., fsdp=True)`` builds a :class:`MegatronCPFSDPStrategy` from the other arguments.

    A metaclass rather than ``__new__``: jsonargparse (``LightningCLI``) documents and validates a class's
    ``__new__`` arguments when it defines one, and ``MegatronCPStrategy.__init__``'s must stay the ones shown.
    """

    def __call__(cls, *args: Any, fsdp: bool = False, **kwargs: Any) -> Any:
        if not fsdp:
            return super().__call__(*args, **kwargs)
        fsdp_arguments = inspect.signature(MegatronCPFSDPStrategy).parameters
        ddp_options = _check_ddp_keywords({k: v for k, v in kwargs.items() if k not in fsdp_arguments})
        given = sorted(name for name, value in ddp_options.items() if value is not None)
        if given:
            raise ValueError(
                f"MegatronCPStrategy(fsdp=True) got DDP option(s) {given}, which FSDP does not use: remove them, "
                "or use fsdp=False."
            )
        return MegatronCPFSDPStrategy(*args, **{k: v for k, v in kwargs.items() if k in fsdp_arguments})


class MegatronCPStrategy(MegatronCPBase, metaclass=_FSDPSwitch):
    """Context-parallel (and tensor-parallel) training, gradients averaged by DDP over the DP x CP ranks.

    ``Trainer(strategy=MegatronCPStrategy(cp=4))`` trains the same model on the same data as DDP, with
    every sequence split over ``cp`` ranks. What it shares with the FSDP strategy (Megatron-core groups,
    :attr:`layout`, :attr:`device_mesh`, sampling over DP, batch sharding, the attention check, SIGTERM,
    atomic checkpoints) is described in :class:`~lightning_cp.strategies.base.MegatronCPBase`. Here:

    - gradients are averaged over DP x CP by ``DistributedDataParallel`` on ``layout.loss_group``: with
      the loss normalized as :class:`lightning_cp.CPLossMixin` does, the update equals a single process on
      the global batch. A single replica (``dp * cp == 1``, e.g. one device) has nothing to average and is
      trained unwrapped;
    - parameters that are not tensor-parallel shards are broadcast within the TP group before DDP
      broadcasts over DP x CP, so every replica starts from the same weights; to evaluate (``validate``,
      ``test``, ``predict``: no DDP wrapper) the same two broadcasts, where Lightning's DDP setup would
      broadcast rank 0's whole module over the world and give every TP rank TP rank 0's shards;
    - ``fsdp=True`` returns a :class:`~lightning_cp.MegatronCPFSDPStrategy` built from the other arguments
      instead (``MegatronCPStrategy(cp=2, fsdp=True)`` is ``MegatronCPFSDPStrategy(cp=2)``), so that a YAML
      config switches to FSDP with one key.

    Args:
        cp: context-parallel size (ranks that share one sequence).
        tp: tensor-parallel size (ranks that share one layer's weights).
        fsdp: build a :class:`~lightning_cp.MegatronCPFSDPStrategy` (FSDP2 over DP x CP) instead. Needs ``tp=1``.
        fsdp_wrap: with ``fsdp=True``, the FSDP units (see :class:`~lightning_cp.MegatronCPFSDPStrategy`).
        activation_checkpointing: modules (classes or class names) whose activations are recomputed in
            backward (non-reentrant). Default: none.
        offload_activations: keep the ``activation_checkpointing`` modules' saved inputs in host memory between
            forward and backward, copied back ahead of need. Needs ``activation_checkpointing``.
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
        **kwargs: ``DDPStrategy``'s communication-hook options and
            :class:`~torch.nn.parallel.DistributedDataParallel` options (``find_unused_parameters``, ...).

    Raises:
        TypeError: ``cp`` or ``tp`` is not an integer, an unknown keyword argument, or
            ``activation_checkpointing`` holds something that is neither a module class nor a name.
        ValueError: ``cp`` or ``tp`` < 1, ``fsdp_wrap`` without ``fsdp=True``, DDP options with
            ``fsdp=True``, ``offload_activations`` without ``activation_checkpointing``, or the world size is not divisible by ``tp * cp`` (raised when the Trainer is
            built, before any process is launched or collective is run). At setup: an
            ``activation_checkpointing`` entry that matches no module, or (``cp > 1``) a model with attention
            that is not context-parallel.

    Example::

        trainer = Trainer(accelerator="cpu", devices=4, strategy=MegatronCPStrategy(cp=2))  # dp=2 x cp=2
    """

    strategy_name = "megatron_cp"

    def __init__(
        self,
        cp: int = 1,
        tp: int = 1,
        fsdp: bool = False,
        fsdp_wrap: Sequence[ModuleSpec] | None = None,
        activation_checkpointing: Sequence[ModuleSpec] | None = None,
        offload_activations: bool = False,
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
        # `fsdp=True` never gets here (the metaclass builds a MegatronCPFSDPStrategy); it is an argument so
        # that configs and `--help` show it.
        if fsdp_wrap is not None:
            raise ValueError(
                f"MegatronCPStrategy(fsdp_wrap={fsdp_wrap!r}) names FSDP units, but fsdp is False: set fsdp=True "
                "(or use MegatronCPFSDPStrategy), or remove fsdp_wrap."
            )
        super().__init__(
            cp=cp,
            tp=tp,
            activation_checkpointing=activation_checkpointing,
            offload_activations=offload_activations,
            checkpoint_io=checkpoint_io,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **_check_ddp_keywords(kwargs),
        )

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)
            return
        self._prepare_module()
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._broadcast_within_tp(self.model)
        broadcast_from_first([*self.model.parameters(), *self.model.buffers()], self.layout.loss_group)
        self.setup_precision_plugin()

    @override
    def configure_ddp(self) -> None:
        """Wrap the model in DDP over ``layout.loss_group``; a single replica stays unwrapped."""
        assert self.model is not None
        self._broadcast_within_tp(self.model)
        if self.layout.loss_group is None:  # dp * cp == 1: no other replica to average with
            return
        super().configure_ddp()

    @override
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        # Lightning's own construction (side CUDA stream, device ids), over the DP x CP ranks only.
        self._ddp_kwargs["process_group"] = self.layout.loss_group
        return super()._setup_model(model)

    def _broadcast_within_tp(self, model: Module) -> None:
        """TP peers are not in DDP's group: give them the replicated (non-sharded) weights of TP rank 0."""
        tensors = [*model.parameters(), *model.buffers()]
        replicated = [t for t in tensors if not getattr(t, "tensor_model_parallel", False)]
        broadcast_from_first(replicated, self.layout.tp_group)
