"""The model of :class:`~lightning_cp.MegatronCPFSDPStrategy` called outside the step: a callback's forward or
``generate``, a teacher, an evaluation hook.

Between steps the root unit's parameters (those in no ``fsdp_wrap`` unit: the embedding, the head, the final
norm) are this rank's shards, which a module cannot compute with. :func:`callable_outside_the_step` gathers
them for the outermost call made while they are sharded, and reshards them after it. Gathering is a
collective over every rank, so every rank must make the same calls, in the same order: a call on rank 0
alone would wait forever for the others, which meanwhile start the next step's collectives. Before each
gather the ranks agree that they all make the call (:class:`OutsideCallAgreement`), in a loop that runs the
process's signal handlers: a rank that calls alone raises an error naming that rule after
:data:`OUTSIDE_CALL_TIMEOUT_S`, or at once on SIGTERM, instead of hanging, and leaves no collective in
flight, so that its run ends with the error (the other ranks stop when it has gone).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

OUTSIDE_CALL_TIMEOUT_S = 120.0
"""How long a rank that calls the model outside the step waits for every other rank to make the call too.
The ranks reach it in the same hook of the same step; two minutes leave room for one rank's slower logging
or I/O before it, and end a call made on one rank only (``if trainer.is_global_zero``) with an error."""

_POLL_S = 0.05
"""The longest sleep between two looks at the agreement (the process's signal handlers run in between)."""

_ARRIVED = "arrived"
"""The store key counting every rank's calls."""
_CLOSED = "closed"
"""The store key counting the ranks that closed the agreement (their run ended)."""


class OutsideCallAgreement:
    """Every rank's confirmation, before the root unit is gathered for a call outside the step, that every
    other rank makes the call too.

    The ranks count their calls in a key of the default process group's store (a TCP store, not a
    collective): the ``k``-th call of each rank returns once the count reaches ``k * world_size``. A rank
    that gives up leaves nothing in flight, so its run can end at once: a collective left waiting for a peer
    that never joins it would block the process in its teardown and at its exit, while the other ranks wait
    in the next step's collectives.

    Args:
        store: a store every rank reaches, of this agreement alone (see :meth:`over_world`); ``None`` for
            one rank.
        world_size: the number of ranks that make every call.
        stopping: whether this rank was asked to stop (SIGTERM): the wait then ends with the error at once.
        timeout_s: how long to wait for the other ranks.
    """

    def __init__(
        self,
        store: dist.Store | None,
        world_size: int,
        stopping: Callable[[], bool],
        timeout_s: float = OUTSIDE_CALL_TIMEOUT_S,
    ) -> None:
        self.store = store
        self.world_size = world_size
        self.stopping = stopping
        self.timeout_s = timeout_s
        self._calls = 0

    @classmethod
    def over_world(cls, stopping: Callable[[], bool]) -> OutsideCallAgreement:
        """An agreement over every rank of the default process group (none is needed for one process), in
        the group's store under a name rank 0 draws (also on an NCCL world the wait never queues behind the
        training's collectives).

        Communication: a broadcast of the name over the default group (every rank must call this).
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls(None, 1, stopping)
        name = [uuid.uuid4().hex]
        dist.broadcast_object_list(name, src=0)
        shared = dist.distributed_c10d._get_default_store()  # the default group's: every rank reaches it
        store = dist.PrefixStore(f"lightning_cp/outside_call/{name[0]}/", shared)
        return cls(store, dist.get_world_size(), stopping)

    def __call__(self) -> None:
        """Return once every rank has made this call; raise if one does not.

        Communication: an increment of one counter in :attr:`store`, then reads of it (and of whether a
        rank has closed the agreement), polled.

        Raises:
            RuntimeError: the other ranks did not make the call within :attr:`timeout_s`, stopped taking
                part (their run ended, or the store's host, rank 0, is gone), or this rank received SIGTERM
                while waiting. The run must end.
        """
        if self.store is None:
            return
        self._calls += 1
        target = self._calls * self.world_size
        self._add(_ARRIVED, 1)
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        while self._add(_ARRIVED, 0) < target:
            # A rank that made this call and then ended its run has closed the agreement, but its call counts:
            # it was counted before the mark, so the count is read again after it.
            if self._add(_CLOSED, 0) and self._add(_ARRIVED, 0) < target:
                self._refuse("they stopped taking part")
            if self.stopping():
                self._refuse("SIGTERM arrived while this rank waited for them")
            if time.monotonic() > deadline:
                self._refuse(f"none came within {self.timeout_s:.0f} s")
            time.sleep(pause)  # a signal's Python handler runs here, not inside a blocking wait
            pause = min(2 * pause, _POLL_S)

    def close(self) -> None:
        """Tell a rank still waiting for a call that this one will not make it; release the store.

        Communication: an increment in :attr:`store` (skipped when its host is gone); no rank waits.
        """
        if self.store is None:
            return
        with contextlib.suppress(RuntimeError):
            self.store.add(_CLOSED, 1)
        self.store = None

    def _add(self, key: str, amount: int) -> int:
        assert self.store is not None
        try:
            return self.store.add(key, amount)
        except RuntimeError:  # the store's host (rank 0's process) is gone
            self._refuse("they stopped taking part")

    def _refuse(self, reason: str) -> NoReturn:
        raise RuntimeError(
            f"rank {dist.get_rank()} of {self.world_size} called the model outside the training step (a forward "
            f"or generate in a callback or hook) and waited for the other ranks to make the same call: {reason}. "
            "Under MegatronCPFSDPStrategy every rank must make the same calls outside the step, in the same "
            "order, because each gathers the root unit's sharded parameters from every rank: call it on every "
            "rank, not under `if trainer.is_global_zero` (and generate on prompts that differ by rank with "
            "synced_gpus=True)."
        ) from None


def callable_outside_the_step(root: nn.Module, agree: Callable[[], None]) -> None:
    """Let the modules of ``root``'s ``LightningModule`` (``root``: the :func:`~lightning_cp.strategies._fsdp.shard`
    result) be called outside the step, on every rank.

    A forward pre-hook on every module whose subtree holds root-unit parameters (from the
    ``LightningModule``'s children down to those parameters' owners) gathers the root unit for the outermost
    such call made while it is sharded (``root.unshard()``), after ``agree()`` (every rank makes the call:
    :class:`OutsideCallAgreement`), and a forward hook reshards it after that call, also when it raises;
    calls nested in it (the decoder inside the causal LM, the embedding inside the decoder) are counted, not
    gathered again. Inner units gather and reshard their own as in any forward. Inside a step (the root
    gathered by FSDP's own hooks) the hooks do nothing. The weights are those of the step (under
    ``bf16-mixed``, in bf16): a call equals the unsharded model's. Meant for inference
    (``torch.no_grad()``): a backward through such a call is not reduced over the ranks.

    Communication, per outermost call made outside the step: ``agree()``, an all-gather of the root unit
    over its mesh (every rank must make the call), and each inner unit's own all-gather as it runs.
    """
    inner = root.module
    names = dict(inner.named_modules())
    units = [name for name, module in names.items() if isinstance(module, FSDPModule)]
    owners = [
        name
        for name, module in names.items()
        if next(module.parameters(recurse=False), None) is not None
        and not any(name == unit or name.startswith(f"{unit}.") for unit in units)
    ]
    if not owners:
        return
    sample = names[owners[0]], next(name for name, _ in names[owners[0]].named_parameters(recurse=False))
    gatherer = _GatherOutsideTheStep(root, *sample, agree)
    # Each owner and its ancestors below the LightningModule (whose own calls are the steps).
    hooked = {
        ".".join(parts[:depth])
        for parts in (o.split(".") for o in owners)
        for depth in range(1, len(parts) + 1)
    }
    for name in sorted(hooked):
        module = names[name]
        module.register_forward_pre_hook(gatherer.before)
        module.register_forward_hook(gatherer.after, always_call=True)


class _GatherOutsideTheStep:
    """The hooks of :func:`callable_outside_the_step`: the root unit gathered for the outermost call made
    while it is sharded (read on one of its parameters, as its owner module holds it now)."""

    def __init__(self, root: nn.Module, owner: nn.Module, parameter: str, agree: Callable[[], None]) -> None:
        self.root, self.owner, self.parameter, self.agree = root, owner, parameter, agree
        self.depth = 0
        """Calls in progress since this object gathered the root (0: it holds nothing)."""

    def before(self, module: nn.Module, args: Any) -> None:
        if self.depth:
            self.depth += 1
        elif isinstance(self.owner._parameters[self.parameter], DTensor):
            self.agree()
            self.root.unshard()
            self.depth = 1

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.depth:
            self.depth -= 1
            if not self.depth:
                self.root.reshard()
