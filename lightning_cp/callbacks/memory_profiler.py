"""``MemoryProfilerCallback``: CUDA memory snapshots of chosen training steps and of OOMs.

Works in any Lightning project, with or without ``MegatronCPStrategy``; under Megatron's parallel
state the DP / CP / TP coordinates of the rank go into the file names. The callback is the Lightning
hooks only; each job is a module of :mod:`lightning_cp.callbacks.memory`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_cp.callbacks.memory import report
from lightning_cp.callbacks.memory.dump import SNAPSHOT_FILENAME, dump_snapshot, writable_error
from lightning_cp.callbacks.memory.peaks import (
    PEAK_ALLOCATED_KEY,
    PEAK_RESERVED_KEY,
    PEAK_RSS_KEY,
    peak_metrics,
)
from lightning_cp.callbacks.memory.recording import AllocatorRecording
from lightning_cp.callbacks.memory.schedule import Ranks, StepSchedule, Window, check_ranks, rank_selected
from lightning_cp.callbacks.memory.tensors import TensorsByDevice, known_tensors

__all__ = [
    "PEAK_ALLOCATED_KEY",
    "PEAK_RESERVED_KEY",
    "PEAK_RSS_KEY",
    "SNAPSHOT_FILENAME",
    "MemoryProfilerCallback",
]


class MemoryProfilerCallback(Callback):
    r"""Record CUDA allocator history around chosen training steps and dump it, on selected ranks.

    For each recorded step (or window of steps) and each selected rank this writes, to ``dirpath``:

    - ``step_000010.rank03.dp1-cp1-tp0.pickle``: ``torch.cuda.memory._snapshot()`` (pickle protocol 4),
      which pytorch.org/memory_viz opens (see :data:`~lightning_cp.callbacks.memory.dump.SNAPSHOT_FILENAME`);
    - ``.md``: the peak broken down by category (parameters, gradients, optimizer state, buffers,
      activations and temporaries, other) and the largest allocations live at the peak, with the tensors
      they hold and their Python stacks;
    - ``.png``: allocated memory by category over the recorded events, the reserved memory and the peak
      (needs matplotlib: ``pip install lightning-cp[report]``; without it the other files are written);
    - ``.html``: PyTorch's interactive timeline (it loads its JavaScript from a CDN, so the PNG and
      markdown are the offline view).

    Recording uses ``torch.cuda.memory._record_memory_history(enabled="all", stacks=..., max_entries=...)``
    from ``on_train_batch_start`` of a window's first step to ``on_train_batch_end`` of its last step
    (after that step's optimizer step, so every micro-batch of gradient accumulation is included), and
    is turned off after the dump. Blocks allocated before recording started (the parameters, usually)
    are counted but have no stack, so the report says what they hold instead: at the dump the callback
    finds which blocks hold the ``LightningModule``'s parameters, their ``.grad`` and its buffers, and the
    state of ``trainer.optimizers`` (by the address range of each tensor on the snapshot's device); for
    the blocks freed during the recording (the previous step's gradients, which ``zero_grad`` frees after
    the forward pass) it uses the tensors that existed when recording started. Other blocks allocated
    while recording are activations and temporaries; other blocks allocated before are "other".

    **Out-of-memory errors.** With ``dump_on_oom``, an OOM while recording is on writes
    ``oom_step_000010.rank03...pickle`` (and its report) before the error propagates: from the
    allocator's OOM observer, so the dump happens even when the error is caught elsewhere, and from
    ``on_exception`` for a ``torch.OutOfMemoryError`` the observer did not see. A dump needs a recorded
    history, hence the trade-off: with ``steps`` given, only OOMs inside those steps are dumped (no
    overhead elsewhere); with ``steps=None`` recording runs from ``setup`` to ``teardown`` of
    ``fit``, which catches an OOM at any step (the parameters' stacks included) at the cost of about
    2 us per allocation and up to ``max_entries`` trace entries of host memory (a few KB each) per rank.

    **Logged** (``log_peak``, every training batch, on every rank, as the maximum over ranks):
    ``memory/peak_allocated_gib`` and ``memory/peak_reserved_gib`` (``torch.cuda.max_memory_allocated``
    / ``max_memory_reserved``, whose peak is reset at each batch start), or without CUDA
    ``memory/peak_rss_gib`` (the process's peak RSS since it started). The maximum is one scalar
    all-reduce per key over the world group, which every rank reaches, so it never hangs.

    Without CUDA this warns once in ``setup`` and writes nothing; without matplotlib it warns once in
    ``setup`` and writes no PNG.

    Args:
        steps: global steps (``trainer.global_step`` at the batch start) to record. Each item is a
            step (``10``) recorded and dumped alone, or a window ``"first-last"`` (``"10-12"``) recorded
            as one history and dumped once. ``None``: no step dumps; with ``dump_on_oom`` the whole fit
            is recorded for an OOM dump.
        ranks: ``"all"``, ``"local_zero"`` (local rank 0 of each node), or a list of global ranks.
        max_entries: ring-buffer size of the allocator trace: only the newest ``max_entries`` events
            are kept, which bounds host memory on long windows.
        dirpath: where files go. Default: ``<trainer.log_dir>/memory_snapshots``.
        stacks: ``"python"`` records Python frames only, which keeps each dump to seconds; ``"all"``
            adds C++ frames (much slower to record and to dump).
        dump_on_oom: dump a snapshot when CUDA runs out of memory while recording (see above).
        log_peak: log the per-batch peak memory (see above).

    Raises:
        ValueError: if ``steps``, ``ranks``, ``max_entries`` or ``stacks`` is malformed.
        MisconfigurationException: in ``setup``, if ``dirpath`` cannot be created or written on a
            selected rank (raised on every rank, so no rank is left waiting in a collective).

    Example::

        from lightning.pytorch import Trainer
        from lightning_cp.callbacks import MemoryProfilerCallback

        # step 3 alone, and steps 10 to 12 as one recording, on local rank 0 of each node
        trainer = Trainer(callbacks=[MemoryProfilerCallback(steps=[3, "10-12"], ranks="local_zero")])

    The same in a LightningCLI config::

        trainer:
          callbacks:
            - class_path: lightning_cp.callbacks.MemoryProfilerCallback
              init_args: {steps: [3, "10-12"], ranks: local_zero}
    """

    def __init__(
        self,
        steps: Sequence[int | str] | None = None,
        ranks: Literal["all", "local_zero"] | list[int] = "all",
        max_entries: int = 100_000,
        dirpath: str | Path | None = None,
        stacks: Literal["python", "all"] = "python",
        dump_on_oom: bool = True,
        log_peak: bool = True,
    ) -> None:
        super().__init__()
        self._schedule = StepSchedule(steps)
        check_ranks(ranks)
        if max_entries < 1:
            raise ValueError(
                f"max_entries={max_entries} must be a positive number of trace entries, e.g. 100_000."
            )
        if stacks not in ("python", "all"):
            raise ValueError(f"stacks={stacks!r} must be 'python' (fast dumps) or 'all' (adds C++ frames).")
        self.steps = steps
        self.ranks: Ranks = ranks
        self.max_entries = max_entries
        self.dirpath = dirpath
        self.stacks = stacks
        self.dump_on_oom = dump_on_oom
        self.log_peak = log_peak

        self._recording = AllocatorRecording(
            stacks, max_entries, on_oom=self._on_allocator_oom if dump_on_oom else None
        )
        self._cuda = False
        self._snapshots_on = False  # CUDA is available and this rank is selected
        self._dir: Path | None = None
        self._rank = 0
        self._step = 0  # global step of the current batch, for OOM dumps
        self._active: Window | None = None  # (first recorded step, last step) of the open window
        self._oom_dumped_step: int | None = None
        self._warned_no_cuda = False
        self._warned_no_plot = False
        self._trainer: Trainer | None = None  # set in setup: the dumps look up the model and optimizers
        self._tensors_at_start: TensorsByDevice = {}

    @property
    def _record_whole_fit(self) -> bool:
        return not self._schedule.windows and self.dump_on_oom

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._cuda = torch.cuda.is_available()
        self._schedule.reset()
        if not self._cuda:
            if not self._warned_no_cuda:
                rank_zero_warn(
                    "MemoryProfilerCallback: CUDA is not available, so no memory snapshots are recorded or "
                    "written."
                    + (" log_peak logs the peak RSS of each process instead." if self.log_peak else "")
                )
                self._warned_no_cuda = True
            return
        if (
            (self._schedule.windows or self.dump_on_oom)
            and not report.can_plot()
            and not self._warned_no_plot
        ):
            rank_zero_warn(
                "MemoryProfilerCallback: matplotlib is not installed, so the snapshots get their markdown "
                "report but no PNG. `pip install lightning-cp[report]` adds it."
            )
            self._warned_no_plot = True
        self._trainer = trainer
        self._rank = trainer.global_rank
        if isinstance(self.ranks, list) and any(r >= trainer.world_size for r in self.ranks):
            rank_zero_warn(
                f"MemoryProfilerCallback(ranks={self.ranks}): ranks >= world_size={trainer.world_size} "
                "never record."
            )
        self._snapshots_on = rank_selected(self.ranks, trainer.global_rank, trainer.local_rank)
        if self.dirpath is not None:
            self._dir = Path(self.dirpath)
        else:  # ``trainer.log_dir`` broadcasts from rank 0: every rank asks, selected or not
            self._dir = Path(trainer.log_dir or trainer.default_root_dir) / "memory_snapshots"
        error = writable_error(self._dir) if self._snapshots_on else None
        if not trainer.strategy.reduce_boolean_decision(error is None, all=True):
            reason = f"on rank {trainer.global_rank}: {error}" if error else "on another rank (see its error)"
            raise MisconfigurationException(
                f"MemoryProfilerCallback(dirpath={str(self._dir)!r}) cannot be written {reason}. "
                "Pass a writable dirpath=..."
            )
        if self._snapshots_on and self._record_whole_fit:
            self._start()

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step = trainer.global_step
        if self._snapshots_on and self._active is None and not self._record_whole_fit:
            self._active = self._schedule.open_at(self._step)
            if self._active is not None:
                self._start()
        if self.log_peak and self._cuda:
            torch.cuda.reset_peak_memory_stats()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # ``global_step`` counts optimizer steps, so it passes ``last`` only after the last micro-batch of it.
        if self._active is not None and trainer.global_step > self._active[1]:
            self._dump("step", *self._active)
            self._stop()
        if self.log_peak:
            pl_module.log_dict(
                peak_metrics(self._cuda), on_step=True, on_epoch=False, sync_dist=True, reduce_fx="max"
            )

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active is None:
            return
        first, last = self._active
        done = max(first, trainer.global_step - 1)
        warnings.warn(
            f"MemoryProfilerCallback: training ended at step {trainer.global_step} inside the window "
            f"{first}-{last}; dumping steps {first}-{done}."
        )
        self._dump("step", first, done)
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        is_oom = isinstance(exception, torch.OutOfMemoryError)
        if not self._recording.on:
            if is_oom and self.dump_on_oom and self._snapshots_on:
                warnings.warn(
                    f"MemoryProfilerCallback: out of memory at step {self._step} on rank {self._rank} while "
                    "not recording, so nothing was dumped. "
                    f"Record it with steps=[{self._step}] (or steps=None)."
                )
            return
        try:
            if is_oom and self.dump_on_oom and self._oom_dumped_step != self._step:
                self._dump_oom()
        finally:
            self._stop()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._recording.on:
            self._stop()
        self._trainer = None

    def _start(self) -> None:
        self._recording.start()
        self._tensors_at_start = self._known_tensors()

    def _stop(self) -> None:
        self._recording.stop()
        self._active = None
        self._tensors_at_start = {}

    def _known_tensors(self) -> TensorsByDevice:
        assert self._trainer is not None, "setup() keeps the trainer before anything is recorded"
        return known_tensors(self._trainer.lightning_module, self._trainer.optimizers)

    def _on_allocator_oom(self) -> None:
        """Called by the allocator before it raises an OOM (possibly one that user code catches)."""
        if self._recording.on:
            self._dump_oom()
            self._oom_dumped_step = self._step

    def _dump_oom(self) -> None:
        # On the error path a failed dump must not replace the error being reported (nor, in the
        # allocator's observer, turn into an exception thrown through the allocator).
        try:
            self._dump("oom_step", self._step, self._step)
        except Exception as err:  # noqa: BLE001
            warnings.warn(
                f"MemoryProfilerCallback: could not dump the OOM snapshot on rank {self._rank}: {err!r}"
            )

    def _dump(self, kind: str, first: int, last: int) -> None:
        assert self._dir is not None, "setup() resolves dirpath before anything is recorded"
        dump_snapshot(self._dir, kind, first, last, self._rank, self._known_tensors(), self._tensors_at_start)
