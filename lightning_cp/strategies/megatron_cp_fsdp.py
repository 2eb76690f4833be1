"""``MegatronCPFSDPStrategy``: FSDP2 over the DP x CP ranks, with Megatron-core's groups and sharded checkpoints."""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_cp.checkpoint_format import load_sharded, save_sharded
from lightning_cp.strategies import _fsdp
from lightning_cp.strategies._modules import (
    ModuleSpec,
    check_module_specs,
    default_layer_classes,
    resolve_classes,
)
from lightning_cp.strategies._outside_step import OutsideCallAgreement, callable_outside_the_step
from lightning_cp.strategies.base import MegatronCPBase, broadcast_from_first
from lightning_cp.strategies.integrations import integrations


class MegatronCPFSDPStrategy(MegatronCPBase):
    """Context-parallel training with parameters, gradients and optimizer state sharded by FSDP2 over DP x CP.

    ``Trainer(strategy=MegatronCPFSDPStrategy(cp=4))`` (also ``strategy="megatron_cp_fsdp"``) trains exactly
    as its sibling :class:`~lightning_cp.MegatronCPStrategy` does, with ``fully_shard`` in the place of DDP. What the two share (Megatron-core groups,
    :attr:`layout`, :attr:`device_mesh`, sampling over DP, batch sharding, the attention check, SIGTERM) is
    described in :class:`~lightning_cp.strategies.base.MegatronCPBase`. Here:

    - every ``fsdp_wrap`` module becomes an FSDP unit, all-gathered before its forward and backward; the
      rest of the ``LightningModule`` is the root unit. Each rank holds ``1 / (dp * cp)`` of the parameters,
      gradients and optimizer state (ZeRO-3), sharded over ``layout.loss_group``; FSDP averages the
      gradients over the same ranks as DDP would, so the training is the same;
    - mixed precision follows ``Trainer(precision=...)``: ``bf16-mixed`` keeps fp32 master weights and
      optimizer state, computes in bf16 and reduce-scatters gradients in fp32;
    - a pretrained model built with :func:`~lightning_cp.load_pretrained` in ``configure_model`` (as
      :class:`~lightning_cp.models.HFCausalLM` does for a directory) is built on the ``meta`` device,
      sharded, and each rank allocates and reads only its own shards of the checkpoint's safetensors
      (:func:`~lightning_cp.hf.loading.materialize_pretrained`): no process holds the whole model;
    - the model can be called outside the step (a callback's forward or ``generate``, under
      ``torch.no_grad()``) on every rank: each outermost call gathers the root unit, so every rank must make
      it; a call on some ranks only is an error naming that rule, not a hang
      (:mod:`lightning_cp.strategies._outside_step`);
    - checkpoints are ``torch.distributed.checkpoint`` folders that every rank writes its part of
      (:func:`~lightning_cp.checkpoint_format.save_sharded`), resharded on load for any (dp, cp);
      :func:`~lightning_cp.strategies.consolidate_checkpoint` turns one into an ordinary file;
    - with ``cpu_offload=True`` the model state lives in host memory (FSDP2's ``CPUOffloadPolicy`` on every
      unit; the parameter shards pinned on CUDA): each rank's shards of the parameters, gradients and
      optimizer state, which under ``bf16-mixed`` AdamW are 16 bytes per parameter / (dp * cp) of host
      memory (fp32 weights, gradients and two moments). Each unit's shards are copied to the device for its
      all-gather in the forward and again in the backward (the root unit's once), and its gradient shards
      back after the reduce-scatter: per forward and backward at most twice the rank's parameter shards
      host to device and its gradient shards once device to host (under ``bf16-mixed`` 4 + 4 + 4 bytes per
      parameter / (dp * cp), the weights copied in fp32 and cast on the device). The optimizer steps on the
      host CPU. Buffers (rotary tables), metrics and the module's ``device`` are the compute device's;
      checkpoints, :meth:`full_state_dict`, the export and calls outside the step are the same as without it.

    Args: ``fsdp_wrap``, ``cpu_offload``, and those of :class:`~lightning_cp.strategies.base.MegatronCPBase`
    (``cp``, ``activation_checkpointing``, ``offload_activations``, ``cp_attention``,
    ``kv_heads_per_gather`` and Lightning's; ``tp`` only 1: the TP shards are not DTensors, use
    :class:`~lightning_cp.MegatronCPStrategy` for ``tp > 1``).

    Raises:
        TypeError: ``fsdp_wrap`` holds something that is neither a module class nor a name, ``cpu_offload``
            is not a bool, a DDP option, and those of ``MegatronCPBase``.
        ValueError: ``tp != 1``, ``cpu_offload`` with a ``process_group_backend`` that has no CPU backend
            (the host shards' collectives need one), and those of ``MegatronCPBase``. At setup: a
            ``fsdp_wrap`` entry that matches no module, a precision FSDP does not support, or (``cp > 1``) a
            model CP cannot train exactly.

    Example::

        trainer = Trainer(devices=8, precision="bf16-mixed", strategy=MegatronCPFSDPStrategy(cp=4))
    """

    strategy_name = "megatron_cp_fsdp"

    def __init__(
        self,
        *args: Any,
        fsdp_wrap: Sequence[ModuleSpec] | None = None,
        cpu_offload: bool = False,
        **kwargs: Any,
    ) -> None:
        """
        Args:
            fsdp_wrap: the modules that become FSDP units (gathered one at a time), as classes or class
                names. Default: the ``_no_split_modules`` the model declares (Hugging Face models, the
                package GPT), else none (the whole model is one unit), and an untied token embedding
                (``get_input_embeddings()``, gathered for its forward and its backward only, not held
                through the step in the root unit).
            cpu_offload: keep the shards of the parameters, gradients and optimizer state in host memory
                (16 bytes per parameter / (dp * cp) under ``bf16-mixed`` AdamW) and step the optimizer
                there; each unit is copied to the device for its forward and its backward only. On CUDA
                the process group gets a gloo backend for the host tensors beside NCCL
                (``"cpu:gloo,cuda:nccl"`` unless ``process_group_backend`` is given, which must then
                include a CPU backend).
            *args, **kwargs: the arguments of :class:`~lightning_cp.strategies.base.MegatronCPBase`
                (``MegatronCPFSDPStrategy(4)`` is ``cp=4``, as for ``MegatronCPStrategy``).
        """
        super().__init__(*args, **kwargs)
        if self.tp > 1:
            raise ValueError(
                f"MegatronCPFSDPStrategy(tp={self.tp}): FSDP does not support tensor parallelism here (the TP "
                "shards are not DTensors): use tp=1, or MegatronCPStrategy (DDP) for tp > 1."
            )
        self.fsdp_wrap = check_module_specs(type(self).__name__, "fsdp_wrap", fsdp_wrap)
        if not isinstance(cpu_offload, bool):
            raise TypeError(f"MegatronCPFSDPStrategy(cpu_offload={cpu_offload!r}): give True or False.")
        self.cpu_offload = cpu_offload
        backend = self._process_group_backend
        if cpu_offload and backend is not None and not _has_cpu_backend(backend):
            raise ValueError(
                f"MegatronCPFSDPStrategy(cpu_offload=True, process_group_backend={backend!r}): the shards in "
                "host memory are reduced and gathered on the CPU (gradient clipping's norm, "
                f"full_state_dict), which {backend!r} cannot do: give "
                "process_group_backend='cpu:gloo,cuda:nccl', or leave it unset."
            )
        self._outside_calls: OutsideCallAgreement | None = None

    @classmethod
    @override
    def _wrapper_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """FSDP takes no wrapper options beyond ``fsdp_wrap``."""
        if options:
            raise TypeError(
                f"MegatronCPFSDPStrategy got unexpected keyword argument(s) {sorted(options)}: it takes fsdp_wrap, "
                "cpu_offload, cp, tp, activation_checkpointing, offload_activations, cp_attention, "
                "kv_heads_per_gather and Lightning's strategy arguments "
                "(DDP options belong to MegatronCPStrategy)."
            )
        return options

    @override
    def setup(self, trainer: Trainer) -> None:
        """Shard the model (also to evaluate, so that sharded checkpoints load into it), then the optimizers.

        Replaces ``DDPStrategy.setup``: no DDP wrapper, and no broadcast of the module's states over the world.
        Parameters built on the meta device by :func:`~lightning_cp.load_pretrained` are allocated after
        sharding, each rank its own shards (in host memory under ``cpu_offload``), and read from their
        checkpoint (the model integrations' ``materialize``). Their behavioural probe runs then, on the
        sharded model inside the root's forward, so that no model goes unprobed and no rank holds more than
        one unit gathered. Under ``cpu_offload`` the parameters never go to the device whole:
        ``fully_shard`` copies one unit at a time there and keeps this rank's shards on the host.

        Communication: a broadcast of every parameter not on the meta device over DP x CP (every replica
        starts from the weights of its group's first rank, as DDP's construction does); the planning
        collectives of ``torch.distributed.checkpoint.load`` for pretrained weights; the probe's (FSDP's
        all-gathers of each unit, the comparisons over CP); the creation of the gloo group the ranks agree
        over before a call outside the step.
        """
        self._prepare_module()
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        on_meta = any(p.is_meta for p in self.model.parameters())
        if not on_meta:
            self.model_to_device()
        _fsdp.forget_meshes()  # also what a collective after the last teardown cached (a save after fit)
        wrap = self.fsdp_wrap if self.fsdp_wrap is not None else default_layer_classes(self.model)
        units = resolve_classes(type(self).__name__, "fsdp_wrap", wrap, self.model)
        embeddings = _fsdp.untied_token_embeddings(self.model) if self.fsdp_wrap is None else []
        policy = _fsdp.mixed_precision_policy(str(self.precision_plugin.precision))
        offload = _fsdp.offload_policy(self.cpu_offload, self.root_device)
        group = self.layout.loss_group
        broadcast_from_first([p for p in self.model.parameters() if not p.is_meta], group)
        # FSDP needs a group object also for a single replica, which (tp = 1) is a world of one process.
        mesh = _fsdp.sharding_mesh(group or dist.group.WORLD, self.root_device.type)
        self.model = _fsdp.shard(self.model, mesh, units, policy, also=embeddings, offload=offload)
        self._outside_calls = OutsideCallAgreement.over_world(stopping=self._stopping)
        callable_outside_the_step(self.model, self._outside_calls)
        if on_meta:
            state_device = torch.device("cpu") if self.cpu_offload else self.root_device
            for integration in integrations():
                integration.materialize(self.model, state_device)
            self.model_to_device()
        module = self.lightning_module
        for integration in integrations():
            if integration.holds_models(module):
                probe = partial(integration.probe, module, self.layout, self.root_device)
                _fsdp.call_in_root(self.model, probe)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.cpu_offload:
            # Under cpu_offload an optimizer's state belongs with the parameter shards, on the host.
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        """The model to the compute device; under ``cpu_offload`` everything but its parameters (buffers,
        metrics), whose shards stay in host memory."""
        assert self.model is not None
        if self.cpu_offload:
            _fsdp.to_device_except_parameters(self.model, self.root_device)
        else:
            super().model_to_device()

    @override
    def _get_process_group_backend(self) -> str:
        """Lightning's choice (NCCL on CUDA, gloo on the CPU, or the given one); under ``cpu_offload`` on an
        accelerator, gloo for the CPU beside it (``"cpu:gloo,cuda:nccl"``), as the collectives over the
        host shards (gradient clipping's norm, ``full_state_dict``) run on CPU tensors."""
        backend = super()._get_process_group_backend()
        if self.cpu_offload and not _has_cpu_backend(backend):
            return f"cpu:gloo,{self.root_device.type}:{backend}"
        return backend

    def _stopping(self) -> bool:
        """Whether this rank received SIGTERM (recorded by the package's handler, or Lightning's)."""
        trainer = self.lightning_module.trainer
        return (self._sigterm is not None and self._sigterm.received) or trainer.received_sigterm

    @override
    def _probe_before_wrapping(self) -> None:
        """Nothing: the behavioural probe runs after sharding and loading, in ``setup``."""

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Around ``configure_model``: every integration's ``loading_context`` (with ``transformers``,
        :func:`~lightning_cp.load_pretrained` builds on the meta device)."""
        with ExitStack() as stack:
            for integration in integrations():
                stack.enter_context(integration.loading_context())
            yield

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded states load into the sharded model and optimizers

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint has loaded them

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state: this rank's shards (``DTensor``), nothing gathered."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module)

    @override
    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole weights on global rank 0 (CPU), an empty dict elsewhere: every parameter gathered from
        its shards, one at a time, then copied to rank 0's host memory (no rank holds the model whole on
        the device). Every rank must call it: in a callback during ``fit``, or after ``fit`` returns (the
        trained weights; the strategy's groups are gone then, so the shards are gathered over the default
        process group, which spans the same ranks in the same order: ``tp`` is 1).

        Communication: an all-gather of each parameter over DP x CP (after ``fit``, over the default group).

        Raises:
            RuntimeError: after ``fit``, when the default process group has been destroyed as well.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        mesh = self._gathering_mesh()
        full = {}
        for name, value in get_model_state_dict(self.lightning_module).items():  # this rank's shards
            whole = _fsdp.full_tensor(value, mesh) if isinstance(value, DTensor) else value
            if self.global_rank == 0:
                full[name] = whole.detach().cpu()
        return full

    def _gathering_mesh(self) -> DeviceMesh | None:
        """The mesh to gather the shards over: their own (``None``) while set up; after teardown, which
        destroyed their group, one over the default process group (the same ranks)."""
        if self._layout is not None:
            return None
        if not dist.is_initialized():
            raise RuntimeError(
                "MegatronCPFSDPStrategy.full_state_dict() after the process group was destroyed: the shards "
                "cannot be gathered any more. Call it on every rank before destroy_process_group(), or in a "
                "callback during fit (e.g. on_train_end)."
            )
        return _fsdp.sharding_mesh(dist.group.WORLD, self.root_device.type)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state: this rank's shards, keyed by parameter name."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return get_optimizer_state_dict(self.lightning_module, optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """A folder written by ``torch.distributed.checkpoint``, each rank its own shards (see ``save_sharded``)."""
        if storage_options is not None:
            raise TypeError(
                "MegatronCPFSDPStrategy.save_checkpoint(..., storage_options=...) is not supported: sharded "
                "checkpoints are written by torch.distributed.checkpoint, not the CheckpointIO."
            )
        save_sharded(checkpoint, Path(self.broadcast(filepath)), self.global_rank)

    @override
    def _read_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None, only: set[str] | None
    ) -> dict[str, Any]:
        """Load a sharded folder (resharded by DCP if the layout differs) or a consolidated file.

        The model and optimizer states go straight into the sharded model and optimizers (``only`` those
        tensors of the model, when given); the rest of the checkpoint is returned for Lightning to restore.
        """
        return load_sharded(
            Path(self.broadcast(checkpoint_path)),
            self.lightning_module,
            self.optimizers,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            only=only,
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint has loaded it

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint has loaded it

    @override
    def teardown(self) -> None:
        if self._outside_calls is not None:
            self._outside_calls.close()
            self._outside_calls = None
        if self.lightning_module is not None:
            self.model = self.lightning_module  # the sharded module, without the root wrapper
        super().teardown()
        _fsdp.forget_meshes()


def _has_cpu_backend(backend: str) -> bool:
    """Whether a process group of ``backend`` (``"nccl"``, ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ...) has a
    backend for CPU tensors."""
    return "cpu" in dist.BackendConfig(dist.Backend(backend)).get_device_backend_map()
