"""Stopping every rank within two steps of a SIGTERM, with a checkpoint of the last completed step.

Lightning's SIGTERM handler broadcasts a flag from *inside the signal handler* (2.6, upstream
Lightning-AI/pytorch-lightning#20806). The handler runs between two Python bytecodes of whatever the
rank was doing, usually while its peers are in a gradient all-reduce or a CP all-gather: the broadcast
is matched against the wrong collective and every rank then waits forever. SLURM, Kubernetes and
preemptible clouds send SIGTERM, so this turns every preemption into a hung job.

Here the handler only records the signal (and forwards it to the processes the launcher started).
:class:`StopOnSigterm`, mixed into the package's strategies, has every rank call
:meth:`SigtermAgreement.agree` at the same *check points*, after each optimizer step and each evaluation
step. The ranks agree one check point late, without waiting: each check point starts an all-reduce (MAX)
of the flag, a CPU tensor over a gloo group of its own, and reads the one the previous check point
started, which has had a whole step to arrive. No device stream is involved and the host never waits for
the device, so the CPU keeps running ahead of the GPU. A signal that any rank recorded before check point
``k`` stops every rank after check point ``k + 1``, the same step on every rank. The strategy then sets
Lightning's ``received_sigterm``, the loops raise ``SIGTERMException`` at the end of that step, and
:class:`PreemptionCheckpoint` writes the checkpoint ``ckpt_path="last"`` resumes from.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

PREEMPTED_EXIT_STATUS = 128 + signal.SIGTERM
"""Exit status of a run stopped by SIGTERM (143, the shell's convention for a process killed by it)."""


class SigtermAgreement:
    """A SIGTERM flag set by a collective-free handler, agreed on by all ranks one check point later.

    Every rank calls :meth:`agree` at the same check points. Check point ``k`` waits for the all-reduce
    that check point ``k - 1`` started and starts its own without waiting for it, so every rank answers
    the same at every check point, and a signal recorded on any rank before check point ``k`` makes
    :meth:`agree` true from check point ``k + 1`` on.

    Args:
        group: a gloo group over every rank (see :meth:`over_world`), or ``None`` for a single process.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._received = False
        self._stop = False
        self._sent: torch.Tensor | None = None  # the flag of the previous check point, reduced in place
        self._work: dist.Work | None = None

    @classmethod
    def over_world(cls) -> SigtermAgreement:
        """An agreement over every rank of the default process group (none is needed for one process).

        Its group is a new gloo group, also on an NCCL world: the flag stays on the CPU, and its
        all-reduces never queue behind (or between) the training's collectives.

        Communication: the collective creation of the group (every rank must call this).
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        return cls(dist.new_group(backend="gloo"))

    def install(self, launcher: Any | None, previous: Any = None) -> None:
        """Replace the SIGTERM handler (Lightning's, installed when the run started) with this one.

        Args:
            launcher: the strategy's launcher; on the process that started the others it forwards the signal
                to them, so a SIGTERM to the launcher alone reaches every rank.
            previous: the handler in place before Lightning's (the user's own, e.g. flushing a logger); it is
                still called, after the signal is recorded.
        """
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        def record(signum: int, frame: FrameType | None) -> None:
            if not self._received and launcher is not None:
                launcher.kill(signum)
            self._received = True
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, record)

    @property
    def received(self) -> bool:
        """Whether this rank recorded SIGTERM (not yet agreed on: see :meth:`agree`)."""
        return self._received

    def agree(self) -> bool:
        """Whether every rank stops after this check point: the same answer on every rank.

        True from the check point after the first one at which any rank had recorded SIGTERM.

        Communication: waits for the previous check point's all-reduce (MAX) of one integer over
        :attr:`group` and starts this one's asynchronously (gloo, CPU tensors: no device work, no
        host-device synchronization). None after the answer is true, or without a group.
        """
        if self._stop:
            return True
        if self._sent is not None:
            if self._work is not None:
                self._work.wait()
            self._stop = bool(self._sent.item())
        if not self._stop:
            self._sent = torch.tensor([int(self._received)], dtype=torch.int32)
            if self.group is not None:
                self._work = dist.all_reduce(
                    self._sent, op=dist.ReduceOp.MAX, group=self.group, async_op=True
                )
        return self._stop

    def close(self) -> None:
        """Destroy the group. An all-reduce still in flight is dropped, not waited for: nothing needs its
        answer any more, and after a failure a peer may never join it."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        self._work = None


class StopOnSigterm(Strategy):
    """Strategy hooks that stop every rank after the same step when any rank receives SIGTERM.

    Mixed in before Lightning's strategy class (``class S(StopOnSigterm, DDPStrategy)``). Each run gets a
    :class:`SigtermAgreement` over the world when the processes are set up (:meth:`setup_environment`),
    its handler when each stage starts (after Lightning has installed its own), a check point after every
    optimizer step, validation step and test step, and its group destroyed in :meth:`teardown`. Once the
    ranks agree, Lightning's ``received_sigterm`` is set, and the loops raise ``SIGTERMException`` at the
    end of that step on every rank.
    """

    _sigterm: SigtermAgreement | None = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._sigterm = SigtermAgreement.over_world()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._install_sigterm_handler()
        # Lightning 2.6's training loop also broadcasts rank 0's `received_sigterm` before every batch, a
        # world collective on the device read with `.item()`: a host sync per step. The agreement sets it
        # on every rank at the same step, so that broadcast would only repeat it.
        self.lightning_module.trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _nothing

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
        self._stop_on_agreed_sigterm()
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        output = super().validation_step(*args, **kwargs)
        self._stop_on_agreed_sigterm()
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        output = super().test_step(*args, **kwargs)
        self._stop_on_agreed_sigterm()
        return output

    @override
    def teardown(self) -> None:
        if self._sigterm is not None:
            self._sigterm.close()
            self._sigterm = None
        super().teardown()

    def _install_sigterm_handler(self) -> None:
        assert self._sigterm is not None
        # The handler Lightning replaced when the run started (the user's own, if any) keeps being called.
        original = self.lightning_module.trainer._signal_connector._original_handlers.get(signal.SIGTERM)
        self._sigterm.install(self.launcher, previous=original)

    def _stop_on_agreed_sigterm(self) -> None:
        """Make Lightning's loops stop every rank at the end of this step once the ranks agree on SIGTERM."""
        assert self._sigterm is not None
        if self._sigterm.agree():
            self.lightning_module.trainer._signal_connector.received_sigterm = True


def _nothing() -> None:
    pass


class PreemptionCheckpoint(Callback):
    """On a SIGTERM stop of ``fit``, save the last completed step as the ``ModelCheckpoint``'s last checkpoint.

    That is the file ``trainer.fit(ckpt_path="last")`` (``--ckpt_path last``) resumes from. Nothing is
    saved when the trainer has no ``ModelCheckpoint`` (checkpointing disabled). Other exceptions save
    nothing: a rank that fails alone cannot join the collectives a save needs. The package's strategies
    add one to the trainer's callbacks when there is none. It is a plain ``Callback``, not one of
    Lightning's ``Checkpoint`` callbacks: with checkpointing disabled ``trainer.checkpoint_callback`` stays
    ``None``, as Lightning and every caller of it expect (``ckpt_path="best"``, a ``last_model_path``).

    Attributes:
        saved_path: the file written on the last preemption, else ``None``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.saved_path: str | None = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        checkpoint = trainer.checkpoint_callback
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != TrainerFn.FITTING:
            return
        if not isinstance(checkpoint, ModelCheckpoint) or checkpoint.dirpath is None:
            return  # checkpointing disabled
        # The name ModelCheckpoint gives its own last checkpoint (its template, e.g. "{epoch}-last", included).
        progress = {"epoch": trainer.current_epoch, "step": trainer.global_step}
        path = checkpoint.format_checkpoint_name(progress, checkpoint.CHECKPOINT_NAME_LAST)
        trainer.save_checkpoint(path)
        self.saved_path = path
        rank_zero_info(f"Preempted by SIGTERM after step {trainer.global_step}: saved {path}")
