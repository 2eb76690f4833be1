"""``MemoryProfilerCallback``: CUDA memory snapshots of chosen training steps and of OOMs.

Works in any Lightning project, with or without ``MegatronCPStrategy``; under Megatron's parallel
state the DP / CP / TP coordinates of the rank go into the file names.
"""

from __future__ import annotations

import itertools
import os
import pickle
import sys
import tempfile
import warnings
import weakref
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_cp.callbacks import _memory_report
from lightning_cp.parallel.layout import current_layout

#: Name of a snapshot file. ``kind`` is ``step`` (a recorded step or window) or ``oom_step`` (a dump
#: at an out-of-memory error); ``steps`` is ``000010`` or, for a window, ``000010-000012``;
#: ``layout`` is this rank's ``.dp1-cp1-tp0`` in a distributed run and empty in a single process. The offline
#: report and PyTorch's HTML share the stem: ``.png``, ``.md``, ``.html``.
SNAPSHOT_FILENAME = "{kind}_{steps}.rank{rank:02d}{layout}.pickle"

#: Keys logged with ``log_peak``: GiB, the maximum over all ranks of each rank's peak in the step.
PEAK_ALLOCATED_KEY = "memory/peak_allocated_gib"
PEAK_RESERVED_KEY = "memory/peak_reserved_gib"
#: Without CUDA: the process's peak resident set size since it started (the OS cannot reset it per step).
PEAK_RSS_KEY = "memory/peak_rss_gib"

_GIB = float(2**30)
_Window = tuple[int, int]
#: ``{device: {(start, end): (category, name)}}``: the byte ranges of known tensors (see ``_memory_report``).
_TensorsByDevice = dict[torch.device, dict[tuple[int, int], tuple[str, str]]]


class MemoryProfilerCallback(Callback):
    r"""Record CUDA allocator history around chosen training steps and dump it, on selected ranks.

    For each recorded step (or window of steps) and each selected rank this writes, to ``dirpath``:

    - ``step_000010.rank03.dp1-cp1-tp0.pickle``: ``torch.cuda.memory._snapshot()`` (pickle protocol 4),
      which pytorch.org/memory_viz opens (see :data:`SNAPSHOT_FILENAME`);
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
        self._windows = _parse_steps(steps)
        _check_ranks(ranks)
        if max_entries < 1:
            raise ValueError(
                f"max_entries={max_entries} must be a positive number of trace entries, e.g. 100_000."
            )
        if stacks not in ("python", "all"):
            raise ValueError(f"stacks={stacks!r} must be 'python' (fast dumps) or 'all' (adds C++ frames).")
        self.steps = steps
        self.ranks = ranks
        self.max_entries = max_entries
        self.dirpath = dirpath
        self.stacks = stacks
        self.dump_on_oom = dump_on_oom
        self.log_peak = log_peak

        self._cuda = False
        self._snapshots_on = False  # CUDA is available and this rank is selected
        self._dir: Path | None = None
        self._rank = 0
        self._step = 0  # global step of the current batch, for OOM dumps
        self._recording = False
        self._active: _Window | None = None  # (first recorded step, last step) of the open window
        self._done: set[_Window] = set()
        self._oom_dumped_step: int | None = None
        self._observer_attached = False
        self._warned_no_cuda = False
        self._warned_no_plot = False
        self._trainer: Trainer | None = None  # set in setup: the dumps look up the model and optimizers
        self._tensors_at_start: _TensorsByDevice = {}

    @property
    def _record_whole_fit(self) -> bool:
        return not self._windows and self.dump_on_oom

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._cuda = torch.cuda.is_available()
        self._done.clear()
        if not self._cuda:
            if not self._warned_no_cuda:
                rank_zero_warn(
                    "MemoryProfilerCallback: CUDA is not available, so no memory snapshots are recorded or "
                    "written."
                    + (" log_peak logs the peak RSS of each process instead." if self.log_peak else "")
                )
                self._warned_no_cuda = True
            return
        if (self._windows or self.dump_on_oom) and not _memory_report.can_plot() and not self._warned_no_plot:
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
        self._snapshots_on = _rank_selected(self.ranks, trainer.global_rank, trainer.local_rank)
        if self.dirpath is not None:
            self._dir = Path(self.dirpath)
        else:  # ``trainer.log_dir`` broadcasts from rank 0: every rank asks, selected or not
            self._dir = Path(trainer.log_dir or trainer.default_root_dir) / "memory_snapshots"
        error = _writable_error(self._dir) if self._snapshots_on else None
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
            window = next(
                (w for w in self._windows if w[0] <= self._step <= w[1] and w not in self._done), None
            )
            if window is not None:
                self._done.add(window)
                self._active = (self._step, window[1])
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
                _peak_metrics(self._cuda), on_step=True, on_epoch=False, sync_dist=True, reduce_fx="max"
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
        if not self._recording:
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
        if self._recording:
            self._stop()
        self._trainer = None

    def _start(self) -> None:
        # clear_history: each window is one recording, without events of an earlier one.
        torch.cuda.memory._record_memory_history(
            enabled="all", stacks=self.stacks, max_entries=self.max_entries, clear_history=True
        )
        self._recording = True
        self._tensors_at_start = self._known_tensors()
        if self.dump_on_oom and not self._observer_attached:
            _attach_oom_observer(self)
            self._observer_attached = True

    def _stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)
        self._recording = False
        self._active = None
        self._tensors_at_start = {}

    def _known_tensors(self) -> _TensorsByDevice:
        assert self._trainer is not None, "setup() keeps the trainer before anything is recorded"
        return _known_tensors(self._trainer.lightning_module, self._trainer.optimizers)

    def _on_allocator_oom(self) -> None:
        """Called by the allocator before it raises an OOM (possibly one that user code catches)."""
        if self._recording and self.dump_on_oom:
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

    def _dump(self, kind: str, first: int, last: int) -> Path | None:
        """Write the snapshot and its reports; returns the pickle path, or ``None`` for an empty trace."""
        assert self._dir is not None, "setup() resolves dirpath before anything is recorded"
        snapshot = torch.cuda.memory._snapshot()
        steps = f"{first:06d}" if first == last else f"{first:06d}-{last:06d}"
        device = _memory_report.busiest_device(snapshot)
        if device is None:
            warnings.warn(
                f"MemoryProfilerCallback: the recording of {kind} {steps} on rank {self._rank} has no "
                "allocator events (does the model run on this rank's CUDA device?); no snapshot written."
            )
            return None
        parallel = current_layout()
        path = self._dir / SNAPSHOT_FILENAME.format(
            kind=kind,
            steps=steps,
            rank=self._rank,
            layout=f".{parallel.tag()}" if parallel.world_size > 1 else "",
        )
        partial = path.with_name(f"{path.name}.partial")
        with open(partial, "wb") as f:
            pickle.dump(snapshot, f, protocol=4)  # protocol 4: what the memory_viz page reads
        os.replace(partial, path)
        self._write_reports(snapshot, path, _snapshot_device(device))
        return path

    def _write_reports(self, snapshot: Mapping[str, Any], path: Path, device: torch.device) -> None:
        """The offline report and PyTorch's HTML next to ``path``; a failure warns and training goes on."""
        stem = path.with_name(path.stem)
        try:
            _memory_report.write_report(
                snapshot,
                stem,
                title=path.stem,
                tensors=self._known_tensors().get(device, {}),
                tensors_at_start=self._tensors_at_start.get(device, {}),
            )
        except Exception as err:  # noqa: BLE001
            warnings.warn(
                f"MemoryProfilerCallback: the offline report for {path.name} failed: {err!r}", stacklevel=2
            )
        try:
            from torch.cuda._memory_viz import trace_plot

            stem.with_name(f"{stem.name}.html").write_text(trace_plot(snapshot))
        except Exception as err:  # noqa: BLE001
            warnings.warn(
                f"MemoryProfilerCallback: PyTorch's HTML view of {path.name} failed: {err!r}", stacklevel=2
            )


def _snapshot_device(index: int) -> torch.device:
    """The device of ``snapshot["device_traces"][index]``: only tensors on it can be in its blocks."""
    return torch.device("cuda", index)


def _known_tensors(module: torch.nn.Module, optimizers: Sequence[Optimizer]) -> _TensorsByDevice:
    """The byte ranges of ``module``'s parameters, gradients and buffers and of the optimizers' state.

    Returns ``{device: {(start, end): (category, name)}}`` with the categories of ``_memory_report``;
    a name is the parameter's (``model.head.weight``), or for optimizer state the key and the parameter
    (``exp_avg of model.head.weight``). A DTensor counts as its local shard, the memory of this rank.
    Reads addresses only: nothing is allocated or synchronized.
    """
    by_device: _TensorsByDevice = defaultdict(dict)

    def add(tensor: torch.Tensor, category: str, name: str) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if tensor.layout != torch.strided or tensor.numel() == 0:
            return
        try:
            start = tensor.data_ptr()
        except RuntimeError:  # wrapper subclasses (e.g. quantized weights) have no storage of their own
            return
        # The elements span up to the last one's offset; a view may skip bytes in between.
        extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        span = (start, start + extent * tensor.element_size())
        by_device[tensor.device].setdefault(span, (category, name))  # the first category listed wins

    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names[id(param)] = name
        add(param, _memory_report.PARAMETERS, name)
        if param.grad is not None:
            add(param.grad, _memory_report.GRADIENTS, name)
    for name, buffer in module.named_buffers():
        add(buffer, _memory_report.BUFFERS, name)
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            owner = names.get(id(param), f"a {tuple(param.shape)} parameter outside the module")
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    add(value, _memory_report.OPTIMIZER_STATE, f"{key} of {owner}")
    return dict(by_device)


def _attach_oom_observer(callback: MemoryProfilerCallback) -> None:
    """Attach an allocator OOM observer that forwards to ``callback`` while it exists.

    PyTorch cannot detach observers, so the observer holds a weak reference: a finished callback is
    not kept alive and its observer does nothing.
    """
    ref = weakref.ref(callback)

    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        target = ref()
        if target is not None:
            target._on_allocator_oom()

    torch._C._cuda_attach_out_of_memory_observer(observer)


def _parse_steps(steps: Sequence[int | str] | None) -> tuple[_Window, ...]:
    """``[3, "10-12"]`` -> ``((3, 3), (10, 12))``: sorted, disjoint, inclusive windows."""
    if steps is None:
        return ()
    if isinstance(steps, (str, int)):
        # ValueError like every other malformed ``steps``, as the docstring promises.
        raise ValueError(f"steps={steps!r} must be a list, e.g. steps=[{steps!r}].")  # noqa: TRY004
    windows = []
    for item in steps:
        text = str(item).strip()
        first, sep, last = text.partition("-")
        try:
            window = (int(first), int(last) if sep else int(first))
        except ValueError:
            raise ValueError(
                f"steps item {item!r} must be a step (10) or a window 'first-last' ('10-12')."
            ) from None
        if window[0] < 0 or window[0] > window[1]:
            raise ValueError(
                f"steps item {item!r} must be non-negative steps with first <= last, e.g. '10-12'."
            )
        windows.append(window)
    windows.sort()
    for before, after in itertools.pairwise(windows):
        if after[0] <= before[1]:
            raise ValueError(
                f"steps={list(steps)!r}: {before[0]}-{before[1]} and {after[0]}-{after[1]} overlap; "
                "merge them into one window."
            )
    return tuple(windows)


def _check_ranks(ranks: object) -> None:
    if ranks in ("all", "local_zero"):
        return
    if not isinstance(ranks, list) or not all(isinstance(r, int) and r >= 0 for r in ranks):
        raise ValueError(
            f"ranks={ranks!r} must be 'all', 'local_zero' or a list of global ranks, e.g. [0, 3]."
        )


def _rank_selected(
    ranks: Literal["all", "local_zero"] | list[int], global_rank: int, local_rank: int
) -> bool:
    if ranks == "all":
        return True
    if ranks == "local_zero":
        return local_rank == 0
    return global_rank in ranks


def _writable_error(dirpath: Path) -> str | None:
    """Create ``dirpath`` and a file in it; the error text if that fails, else ``None``."""
    try:
        dirpath.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=dirpath):
            pass
    except OSError as err:
        return str(err)
    return None


def _peak_metrics(cuda: bool) -> dict[str, float]:
    if cuda:
        return {
            PEAK_ALLOCATED_KEY: torch.cuda.max_memory_allocated() / _GIB,
            PEAK_RESERVED_KEY: torch.cuda.max_memory_reserved() / _GIB,
        }
    return {PEAK_RSS_KEY: _peak_rss_bytes() / _GIB}


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux and macOS)."""
    import resource  # POSIX only; imported here so the module still imports on Windows

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
