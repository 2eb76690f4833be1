"""``MegatronCPStrategy``: DDP over the DP x CP ranks, with Megatron-core's groups."""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from typing_extensions import override

from lightning_cp.strategies.base import MegatronCPBase, broadcast_from_first

# Keywords the strategy passes on: DDPStrategy's own, then DistributedDataParallel's. The strategy sets
# `module`, `device_ids` and the group itself.
_DDP_STRATEGY_KEYWORDS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_DDP_KEYWORDS = tuple(
    name
    for name in inspect.signature(DistributedDataParallel.__init__).parameters
    if name not in ("self", "module", "device_ids", "process_group", "device_mesh")
)


class MegatronCPStrategy(MegatronCPBase):
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
    - FSDP is the sibling class :class:`~lightning_cp.MegatronCPFSDPStrategy` (``strategy="megatron_cp_fsdp"``),
      which takes the same arguments but the DDP options, and ``fsdp_wrap``.

    Args: those of :class:`~lightning_cp.strategies.base.MegatronCPBase` (``cp``, ``tp``,
    ``activation_checkpointing``, ``offload_activations``, ``cp_attention``, ``kv_heads_per_gather`` and
    Lightning's), and as further keywords
    ``DDPStrategy``'s communication-hook options and
    :class:`~torch.nn.parallel.DistributedDataParallel`'s (``find_unused_parameters``, ...).

    Raises:
        TypeError: a keyword that is neither a shared argument nor a DDP option (``fsdp=True``,
            ``cpu_offload``: use ``MegatronCPFSDPStrategy``), and those of ``MegatronCPBase``.
        ValueError: ``process_group`` or ``device_mesh`` given (the strategy sets them), and those of
            ``MegatronCPBase``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=4, strategy=MegatronCPStrategy(cp=2))  # dp=2 x cp=2
    """

    strategy_name = "megatron_cp"

    @classmethod
    @override
    def _wrapper_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """``DDPStrategy``'s and ``DistributedDataParallel``'s options, checked; the group is the strategy's."""
        if "fsdp" in options or "fsdp_wrap" in options:
            name = "fsdp" if "fsdp" in options else "fsdp_wrap"
            raise TypeError(
                f"MegatronCPStrategy({name}=...): FSDP is its own strategy, MegatronCPFSDPStrategy (same arguments; "
                'in YAML class_path: lightning_cp.MegatronCPFSDPStrategy, or strategy: "megatron_cp_fsdp").'
            )
        if "cpu_offload" in options:
            raise TypeError(
                "MegatronCPStrategy(cpu_offload=...): DDP keeps the whole model state on every device; for "
                "the model state in host memory use MegatronCPFSDPStrategy(cpu_offload=True) (same arguments; in "
                "YAML class_path: lightning_cp.MegatronCPFSDPStrategy)."
            )
        for reserved in ("process_group", "device_mesh"):
            # LightningCLI may fill a DDP keyword with its default (None); only a real value conflicts.
            if options.pop(reserved, None) is not None:
                raise ValueError(
                    f"MegatronCPStrategy({reserved}=...): the strategy gives DDP the DP x CP group itself; remove it."
                )
        unknown = sorted(set(options) - set(_DDP_STRATEGY_KEYWORDS) - set(_DDP_KEYWORDS))
        if unknown:
            raise TypeError(
                f"MegatronCPStrategy got unexpected keyword argument(s) {unknown}. It takes cp, tp, "
                "activation_checkpointing, offload_activations, cp_attention, kv_heads_per_gather, the arguments "
                "of DDPStrategy and these "
                f"DistributedDataParallel options: {', '.join(_DDP_KEYWORDS)}."
            )
        return options

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
        """Lightning's own construction (side CUDA stream, device ids), over the DP x CP ranks only.

        Frozen parameters of a tensor subclass (QLoRA's NF4 weights) are left out of DDP: its broadcast at
        construction flattens every parameter into one buffer and copies it back, which would dequantize and
        quantize each one again (not exactly the same weight). They are broadcast here from the group's
        first rank through their codes and scales instead, and DDP never reduces them (no gradient).

        Communication: those broadcasts over ``layout.loss_group``, then DDP's construction.
        """
        group = self.layout.loss_group
        quantized = [
            name
            for name, p in model.named_parameters()
            if not p.requires_grad and is_traceable_wrapper_subclass(p)
        ]
        broadcast_from_first([model.get_parameter(name) for name in quantized], group)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, quantized)
        self._ddp_kwargs["process_group"] = group
        return super()._setup_model(model)

    def _broadcast_within_tp(self, model: Module) -> None:
        """TP peers are not in DDP's group: give them the replicated (non-sharded) weights of TP rank 0."""
        tensors = [*model.parameters(), *model.buffers()]
        replicated = [t for t in tensors if not getattr(t, "tensor_model_parallel", False)]
        broadcast_from_first(replicated, self.layout.tp_group)
