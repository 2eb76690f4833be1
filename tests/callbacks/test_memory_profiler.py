"""``MemoryProfilerCallback`` on CPU: a real ``Trainer``, with the CUDA allocator APIs replaced by fakes.

The fakes log every call into one event list next to the model's ``training_step``, so a test can
read off exactly on which steps recording started, stopped and dumped. The snapshot the fake returns
is written by hand in the recorded format (segments, blocks, device_traces, frames), and its peak is
worked out by hand below, so the offline report is checked against arithmetic, not against itself.
"""

from __future__ import annotations

import copy
import pickle
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import matplotlib.image
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_cp.callbacks import MemoryProfilerCallback, _memory_report, memory_profiler
from lightning_cp.callbacks._memory_report import (
    ACTIVATIONS,
    BUFFERS,
    GRADIENTS,
    OPTIMIZER_STATE,
    OTHER,
    PARAMETERS,
)
from lightning_cp.parallel import ParallelLayout

MiB = 2**20
GiB = 2**30
_S = 64 * MiB  # base address of the segment the trace allocates


def _frames(*entries: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": name} for f, line, name in entries]


_FRAMES_C = _frames(
    ("/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", 125, "forward"),
    ("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", 1775, "_call_impl"),
    ("/home/me/project/model.py", 42, "forward"),
)
_FRAMES_D = _frames(("/home/me/project/model.py", 50, "training_step"))
_FRAMES_E = _frames(
    ("/home/me/project/model.py", 61, "big_buffer"),
    ("??", 0, "c10::cuda::CUDACachingAllocator::malloc"),
    ("/home/me/project/model.py", 70, "training_step"),
)
_FRAMES_F = _frames(("/home/me/project/model.py", 80, "small"))
_FRAMES_A = _frames(("/home/me/project/model.py", 5, "__init__"))


def _recorded_snapshot() -> dict:
    """A snapshot of one device in the format of ``torch.cuda.memory._snapshot()``.

    Before the trace: A (1 MiB, live to the end) and B (0.5 MiB, freed in the trace) -> 1.5 MiB.
    Events: segment +16 MiB; alloc C 2 MiB (3.5); alloc D 3 MiB (6.5); free B (6.0); alloc E 4 MiB
    (10.0 = peak, live: E 4, D 3, C 2, A 1); free D (7.0); alloc F 1 MiB (8.0); free C (6.0); OOM.
    Reserved: 2 MiB segment of A and B before the trace, 18 MiB from event 0 on.
    """

    def ev(action: str, addr: int, size: int, frames: list[dict] = ()) -> dict:
        return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)}

    trace = [
        ev("segment_alloc", _S, 16 * MiB),
        ev("alloc", _S, 2 * MiB, _FRAMES_C),
        ev("alloc", _S + 2 * MiB, 3 * MiB, _FRAMES_D),
        ev("free_requested", 1 * MiB, MiB // 2),
        ev("free_completed", 1 * MiB, MiB // 2),
        ev("alloc", _S + 5 * MiB, 4 * MiB, _FRAMES_E),
        ev("free_requested", _S + 2 * MiB, 3 * MiB),
        ev("free_completed", _S + 2 * MiB, 3 * MiB),
        ev("alloc", _S + 2 * MiB, 1 * MiB, _FRAMES_F),
        ev("free_requested", _S, 2 * MiB),
        ev("free_completed", _S, 2 * MiB),
        {"action": "oom", "size": 64 * MiB, "device_free": 1 * MiB, "stream": 0, "frames": _FRAMES_E},
    ]

    def block(addr: int, size: int, state: str, frames: list[dict] = ()) -> dict:
        return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": list(frames)}

    segments = [
        {
            "device": 0,
            "address": 0,
            "total_size": 2 * MiB,
            "stream": 0,
            "segment_type": "large",
            "allocated_size": 1 * MiB,
            "active_size": 1 * MiB,
            "blocks": [block(0, 1 * MiB, "active_allocated", _FRAMES_A), block(1 * MiB, 1 * MiB, "inactive")],
        },
        {
            "device": 0,
            "address": _S,
            "total_size": 16 * MiB,
            "stream": 0,
            "segment_type": "large",
            "allocated_size": 5 * MiB,
            "active_size": 5 * MiB,
            "blocks": [
                block(_S, 2 * MiB, "inactive"),
                block(_S + 2 * MiB, 1 * MiB, "active_allocated", _FRAMES_F),
                block(_S + 3 * MiB, 2 * MiB, "inactive"),
                block(_S + 5 * MiB, 4 * MiB, "active_allocated", _FRAMES_E),
                block(_S + 9 * MiB, 7 * MiB, "inactive"),
            ],
        },
    ]
    return {"segments": segments, "device_traces": [trace]}


class FakeCuda:
    """The CUDA calls of the callback; every call is appended to ``events`` next to the model's steps."""

    def __init__(
        self, snapshot: dict | Callable[[], dict] | None = None, on_record: Callable[[], None] | None = None
    ) -> None:
        self.events: list[tuple] = []
        self.history_kwargs: list[dict] = []
        self.observers: list = []
        self.snapshot = _recorded_snapshot() if snapshot is None else snapshot  # or a function making one
        self.on_record = on_record  # called when recording starts
        self.max_allocated = 3 * GiB
        self.max_reserved = 5 * GiB

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self._record)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self._snapshot)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.max_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.max_reserved)
        monkeypatch.setattr(
            torch.cuda, "reset_peak_memory_stats", lambda device=None: self.events.append(("reset",))
        )
        # CPU builds of torch have no such function: raising=False adds it.
        monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", self._attach, raising=False)
        return self

    def _record(self, enabled="all", **kwargs) -> None:
        self.events.append(("record", enabled))
        self.history_kwargs.append(kwargs)
        if enabled and self.on_record is not None:
            self.on_record()

    def _snapshot(self, device=None) -> dict:
        self.events.append(("snapshot",))
        return self.snapshot() if callable(self.snapshot) else copy.deepcopy(self.snapshot)

    def _attach(self, observer) -> None:
        self.events.append(("attach",))
        self.observers.append(observer)

    def allocator_oom(self) -> None:
        """What the allocator does before it raises an out-of-memory error."""
        for observer in self.observers:
            observer(0, 64 * MiB, 80 * GiB, 1 * MiB)

    def without(self, *kinds: str) -> list[tuple]:
        return [e for e in self.events if e[0] not in kinds]


class StepModel(BoringModel):
    """``BoringModel`` that logs ``("train", global_step)`` into the fake's event list."""

    def __init__(
        self, events: list[tuple], oom_at: int | None = None, caught_oom: FakeCuda | None = None
    ) -> None:
        super().__init__()
        self.events = events
        self.oom_at = oom_at
        self.caught_oom = caught_oom

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step
        self.events.append(("train", step))
        if step == self.oom_at:
            if self.caught_oom is not None:
                self.caught_oom.allocator_oom()  # user code catches it and goes on
            else:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return super().training_step(batch, batch_idx)


def _fit(
    tmp_path: Path, callback: MemoryProfilerCallback, model: BoringModel, max_steps: int = 6, **kwargs
) -> Trainer:
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[callback],
        limit_val_batches=0,
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"lightning\.pytorch")
        trainer.fit(model)
    return trainer


def _names(dirpath: Path) -> list[str]:
    return sorted(p.name for p in dirpath.iterdir()) if dirpath.exists() else []


def _stems(dirpath: Path) -> set[str]:
    return {n.split(".pickle")[0] for n in _names(dirpath) if n.endswith(".pickle")}


def test_records_single_steps_and_windows(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(
        steps=["3-4", 1], max_entries=1234, dirpath=tmp_path / "snaps", log_peak=False
    )
    _fit(tmp_path, callback, StepModel(fake.events))

    assert fake.events == [
        ("train", 0),
        ("record", "all"),
        ("attach",),
        ("train", 1),
        ("snapshot",),
        ("record", None),
        ("train", 2),
        ("record", "all"),
        ("train", 3),
        ("train", 4),
        ("snapshot",),
        ("record", None),
        ("train", 5),
    ]
    assert fake.history_kwargs[0] == {"stacks": "python", "max_entries": 1234, "clear_history": True}
    assert _names(tmp_path / "snaps") == sorted(
        f"{stem}.{ext}"
        for stem in ("step_000001.rank00", "step_000003-000004.rank00")
        for ext in ("pickle", "png", "md", "html")
    )
    raw = (tmp_path / "snaps" / "step_000001.rank00.pickle").read_bytes()
    assert raw[:2] == b"\x80\x04"  # pickle protocol 4, which the memory_viz page reads
    assert pickle.loads(raw) == _recorded_snapshot()


def test_window_spans_every_micro_batch_of_gradient_accumulation(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=["1-2"], dirpath=tmp_path, log_peak=False, dump_on_oom=False)
    _fit(tmp_path, callback, StepModel(fake.events), max_steps=4, accumulate_grad_batches=2)

    assert fake.events == [
        ("train", 0),
        ("train", 0),
        ("record", "all"),
        ("train", 1),
        ("train", 1),
        ("train", 2),
        ("train", 2),
        ("snapshot",),
        ("record", None),
        ("train", 3),
        ("train", 3),
    ]
    assert _stems(tmp_path) == {"step_000001-000002.rank00"}


def test_window_cut_short_by_max_steps_dumps_what_was_recorded(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=["4-9"], dirpath=tmp_path, log_peak=False)
    with pytest.warns(UserWarning, match="inside the window 4-9; dumping steps 4-5"):
        _fit(tmp_path, callback, StepModel(fake.events), max_steps=6)

    assert fake.without("attach") == [
        ("train", 0),
        ("train", 1),
        ("train", 2),
        ("train", 3),
        ("record", "all"),
        ("train", 4),
        ("train", 5),
        ("snapshot",),
        ("record", None),
    ]
    assert _stems(tmp_path) == {"step_000004-000005.rank00"}


def test_file_names_carry_the_parallel_layout(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    group = object()  # never called into
    layout = ParallelLayout(
        dp=2, cp=2, rank=3, dp_rank=1, cp_rank=1, cp_group=group, dp_group=group, loss_group=group
    )
    monkeypatch.setattr(memory_profiler, "current_layout", lambda: layout)
    _fit(tmp_path, MemoryProfilerCallback(steps=[2], log_peak=False), StepModel(fake.events), max_steps=3)

    # dirpath defaults to <trainer.log_dir>/memory_snapshots; with logger=False log_dir is default_root_dir.
    assert _stems(tmp_path / "memory_snapshots") == {"step_000002.rank00.dp1-cp1-tp0"}


@pytest.mark.parametrize(
    ("ranks", "global_rank", "local_rank", "records"),
    [
        ("all", 3, 1, True),
        ([0, 3], 3, 1, True),
        ([0, 2], 3, 1, False),
        ("local_zero", 3, 1, False),
        ("local_zero", 4, 0, True),
    ],
)
def test_rank_selection(tmp_path, monkeypatch, ranks, global_rank, local_rank, records):
    fake = FakeCuda().install(monkeypatch)
    monkeypatch.setattr(Trainer, "global_rank", property(lambda self: global_rank))
    monkeypatch.setattr(Trainer, "local_rank", property(lambda self: local_rank))
    monkeypatch.setattr(Trainer, "world_size", property(lambda self: 8))
    callback = MemoryProfilerCallback(steps=[1], ranks=ranks, dirpath=tmp_path / "snaps", log_peak=False)
    _fit(tmp_path, callback, StepModel(fake.events), max_steps=2)

    recorded = [e for e in fake.events if e[0] in ("record", "snapshot")]
    if records:
        assert recorded == [("record", "all"), ("snapshot",), ("record", None)]
        assert _stems(tmp_path / "snaps") == {f"step_000001.rank{global_rank:02d}"}
    else:
        assert recorded == []
        assert _names(tmp_path / "snaps") == []


def test_oom_dumps_then_propagates_when_the_whole_fit_is_recorded(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=None, dirpath=tmp_path, log_peak=False)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
        _fit(tmp_path, callback, StepModel(fake.events, oom_at=2))

    # steps=None records from setup on, so the OOM at step 2 finds a recording with history.
    assert fake.events == [
        ("record", "all"),
        ("attach",),
        ("train", 0),
        ("train", 1),
        ("train", 2),
        ("snapshot",),
        ("record", None),
    ]
    assert _stems(tmp_path) == {"oom_step_000002.rank00"}
    assert (tmp_path / "oom_step_000002.rank00.png").exists()


def test_oom_outside_the_recorded_steps_warns_and_dumps_nothing(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=[4], dirpath=tmp_path, log_peak=False)
    with (
        pytest.raises(torch.OutOfMemoryError),
        pytest.warns(UserWarning, match=r"Record it with steps=\[2\]"),
    ):
        _fit(tmp_path, callback, StepModel(fake.events, oom_at=2))

    assert fake.events == [("train", 0), ("train", 1), ("train", 2)]
    assert _names(tmp_path) == []


def test_caught_oom_is_dumped_by_the_allocator_observer(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    callback = MemoryProfilerCallback(steps=["1-3"], dirpath=tmp_path, log_peak=False)
    trainer = _fit(tmp_path, callback, StepModel(fake.events, oom_at=2, caught_oom=fake), max_steps=5)

    assert trainer.global_step == 5
    # The observer is attached once recording is on; the OOM at step 2 dumps, the window dumps at its end.
    assert fake.events == [
        ("train", 0),
        ("record", "all"),
        ("attach",),
        ("train", 1),
        ("train", 2),
        ("snapshot",),
        ("train", 3),
        ("snapshot",),
        ("record", None),
        ("train", 4),
    ]
    assert _stems(tmp_path) == {"oom_step_000002.rank00", "step_000001-000003.rank00"}


def test_other_errors_stop_recording_without_a_dump(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)

    class Broken(StepModel):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 2:
                raise ValueError("a bug in the model")
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match="a bug in the model"):
        _fit(tmp_path, MemoryProfilerCallback(steps=["1-3"], dirpath=tmp_path), Broken(fake.events))

    assert fake.without("reset") == [
        ("train", 0),
        ("record", "all"),
        ("attach",),
        ("train", 1),
        ("record", None),
    ]
    assert _names(tmp_path) == []


def test_oom_seen_by_the_observer_is_not_dumped_twice(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)

    class ObservedOOM(StepModel):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 1:
                fake.allocator_oom()
                raise torch.OutOfMemoryError("CUDA out of memory.")
            return super().training_step(batch, batch_idx)

    with pytest.raises(torch.OutOfMemoryError):
        _fit(tmp_path, MemoryProfilerCallback(dirpath=tmp_path, log_peak=False), ObservedOOM(fake.events))

    assert fake.events.count(("snapshot",)) == 1
    assert fake.events[-1] == ("record", None)
    assert _stems(tmp_path) == {"oom_step_000001.rank00"}


def test_empty_trace_is_skipped_with_a_warning(tmp_path, monkeypatch):
    fake = FakeCuda(snapshot={"segments": [], "device_traces": [[]]}).install(monkeypatch)
    callback = MemoryProfilerCallback(steps=[1], dirpath=tmp_path, log_peak=False)
    with pytest.warns(UserWarning, match="has no allocator events"):
        _fit(tmp_path, callback, StepModel(fake.events), max_steps=3)

    assert ("snapshot",) in fake.events
    assert _names(tmp_path) == []


def test_unwritable_dirpath_fails_at_setup(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    (tmp_path / "a_file").write_text("")
    callback = MemoryProfilerCallback(steps=[1], dirpath=tmp_path / "a_file" / "snaps")
    with pytest.raises(MisconfigurationException, match=r"a_file/snaps.*cannot be written on rank 0"):
        _fit(tmp_path, callback, StepModel(fake.events))

    assert fake.events == []  # not a single training step ran


def test_log_peak_logs_cuda_peaks_and_resets_them_every_batch(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    trainer = _fit(tmp_path, MemoryProfilerCallback(dump_on_oom=False), StepModel(fake.events), max_steps=3)

    assert fake.events == [("reset",), ("train", 0), ("reset",), ("train", 1), ("reset",), ("train", 2)]
    assert trainer.callback_metrics["memory/peak_allocated_gib"].item() == pytest.approx(3.0)
    assert trainer.callback_metrics["memory/peak_reserved_gib"].item() == pytest.approx(5.0)


def _vm_hwm_bytes() -> int:
    """Peak RSS as the kernel reports it in /proc (independent of ``resource.getrusage``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_without_cuda_warns_once_writes_nothing_and_logs_rss(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(a))
    callback = MemoryProfilerCallback(steps=[1, "2-3"], dirpath=tmp_path / "snaps")
    model = StepModel([])
    before = _vm_hwm_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            default_root_dir=tmp_path,
            max_steps=6,
            accelerator="cpu",
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            callbacks=[callback],
            limit_val_batches=0,
        )
        trainer.fit(model)
    after = _vm_hwm_bytes()

    assert trainer.global_step == 6
    assert len([w for w in caught if "CUDA is not available" in str(w.message)]) == 1
    assert calls == []
    assert not (tmp_path / "snaps").exists()
    logged = trainer.callback_metrics["memory/peak_rss_gib"].item() * GiB
    # getrusage's peak trails /proc's VmHWM by a few pages (the kernel updates it lazily); a unit
    # mistake (KiB for bytes) would be off by 1024x.
    assert before - MiB <= logged <= after + MiB


def test_lightning_cli_yaml_reaches_the_callback(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_cp.callbacks.MemoryProfilerCallback\n"
        "      init_args:\n"
        "        steps: [3, '10-12']\n"
        "        ranks: [0, 3]\n"
        "        max_entries: 5000\n"
        f"        dirpath: {tmp_path / 'snaps'}\n"
        "        stacks: all\n"
        "        dump_on_oom: false\n"
        "        log_peak: false\n"
    )
    cli = LightningCLI(BoringModel, run=False, args=["--config", str(config)], save_config_callback=None)

    [callback] = [c for c in cli.trainer.callbacks if isinstance(c, MemoryProfilerCallback)]
    assert list(callback.steps) == [3, "10-12"]
    assert callback.ranks == [0, 3]
    assert callback.max_entries == 5000
    assert Path(callback.dirpath) == tmp_path / "snaps"
    assert callback.stacks == "all"
    assert callback.dump_on_oom is False and callback.log_peak is False


def test_lightning_cli_flags_append_the_callback():
    args = [
        "--trainer.callbacks+=lightning_cp.callbacks.MemoryProfilerCallback",
        '--trainer.callbacks.steps=[2, "5-7"]',
        "--trainer.callbacks.ranks=local_zero",
    ]
    cli = LightningCLI(BoringModel, run=False, args=args, save_config_callback=None)

    [callback] = [c for c in cli.trainer.callbacks if isinstance(c, MemoryProfilerCallback)]
    assert list(callback.steps) == [2, "5-7"]
    assert callback.ranks == "local_zero"
    assert callback.max_entries == 100_000 and callback.stacks == "python"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": "10-12"}, r"steps='10-12' must be a list, e.g. steps=\['10-12'\]"),
        ({"steps": ["12-10"]}, r"steps item '12-10' must be non-negative steps with first <= last"),
        ({"steps": ["ten"]}, r"steps item 'ten' must be a step \(10\) or a window"),
        ({"steps": [5, "3-6"]}, r"3-6 and 5-5 overlap"),
        ({"ranks": "first"}, r"ranks='first' must be 'all', 'local_zero' or a list"),
        ({"ranks": [-1]}, r"ranks=\[-1\] must be"),
        ({"max_entries": 0}, r"max_entries=0 must be a positive"),
        ({"stacks": "cpp"}, r"stacks='cpp' must be 'python'"),
    ],
)
def test_malformed_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemoryProfilerCallback(**kwargs)


def test_offline_report_matches_the_peak_worked_out_by_hand(tmp_path):
    png, md = _memory_report.write_report(
        _recorded_snapshot(), tmp_path / "report", title="step_000001.rank00"
    )

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape[:2] == (400, 1000)
    text = md.read_text()
    assert f"peak allocated: 10.00 MiB ({10 * MiB} bytes), reached at event 5" in text
    assert "reserved at the peak: 18.00 MiB" in text
    assert "allocated when the trace starts: 1.50 MiB" in text
    assert "OOM at event 11: requested 64.00 MiB" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    # Live at the peak, largest first: E (4), D (3), C (2), A (1); B was freed before the peak.
    assert [row.split(" | ")[2] for row in rows] == [str(4 * MiB), str(3 * MiB), str(2 * MiB), str(1 * MiB)]
    assert (
        "`/home/me/project/model.py:61 big_buffer`<br>`/home/me/project/model.py:70 training_step`" in rows[0]
    )
    assert "40.0%" in rows[0]
    # Python frames only, without nn.Module's call plumbing; site-packages prefixes dropped.
    assert "`torch/nn/modules/linear.py:125 forward`<br>`/home/me/project/model.py:42 forward`" in rows[2]
    assert "before the trace" in rows[3] and "model.py:5 __init__" in rows[3]


# --- what the blocks hold ---------------------------------------------------------------------------------


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of a contiguous tensor, from its storage (independent of ``data_ptr``)."""
    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    return start, start + tensor.numel() * tensor.element_size()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(2, 1, bias=False)
        self.register_buffer("scale", torch.ones(5))
        self.far = torch.nn.Parameter(torch.empty(4, device="meta"))  # on another device


def test_known_tensors_are_the_parameters_gradients_buffers_and_optimizer_state():
    net = _Net()
    outside = torch.nn.Parameter(torch.zeros(3))
    flat = torch.zeros(8)  # one buffer for two gradients, as a gradient bucket does
    net.a.weight.grad = flat[:6].view(2, 3)
    net.a.bias.grad = flat[6:]
    strided = torch.zeros(2, 3)
    net.b.weight.grad = strided[:, 0].unsqueeze(0)  # elements 0 and 3 of ``strided``
    outside.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([net.a.weight, net.a.bias, net.b.weight, outside])
    optimizer.step()

    known = memory_profiler._known_tensors(net, [optimizer])

    cpu = torch.device("cpu")
    expected = {
        _span(net.a.weight): (PARAMETERS, "a.weight"),
        _span(net.a.bias): (PARAMETERS, "a.bias"),
        _span(net.b.weight): (PARAMETERS, "b.weight"),
        _span(flat[:6]): (GRADIENTS, "a.weight"),
        _span(flat[6:]): (GRADIENTS, "a.bias"),
        (strided.data_ptr(), strided.data_ptr() + 4 * 4): (GRADIENTS, "b.weight"),
        _span(net.scale): (BUFFERS, "scale"),
    }
    for param, name in [(net.a.weight, "a.weight"), (net.a.bias, "a.bias"), (net.b.weight, "b.weight")] + [
        (outside, "a (3,) parameter outside the module")
    ]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            expected[_span(optimizer.state[param][key])] = (OPTIMIZER_STATE, f"{key} of {name}")
    assert known[cpu] == expected
    assert set(known) == {cpu, torch.device("meta")}
    assert list(known[torch.device("meta")].values()) == [(PARAMETERS, "far")]


def test_gradients_sharing_one_block_are_named_together():
    net = _Net()
    flat = torch.zeros(8)
    net.a.weight.grad = flat[:6].view(2, 3)
    net.a.bias.grad = flat[6:]
    block = {"address": flat.data_ptr(), "size": 32, "state": "active_allocated", "frames": []}
    snapshot = {
        "segments": [{"device": 0, "address": flat.data_ptr(), "total_size": 32, "blocks": [block]}],
        "device_traces": [[{"action": "alloc", "addr": 1, "size": 4, "frames": []}]],
    }
    known = memory_profiler._known_tensors(net, [])[torch.device("cpu")]

    [held] = [a for a in _memory_report.analyze(snapshot, 0, known).allocations if a.addr == flat.data_ptr()]
    assert (held.category, held.tensors) == (GRADIENTS, ("a.weight", "a.bias"))


def _dtensor_ranges() -> bool:
    """On each rank of 2: a DTensor parameter (and gradient) counts as this rank's shard of it."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    net = torch.nn.Linear(4, 6, bias=False)
    net.weight = torch.nn.Parameter(distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)]))
    net.weight.grad = distribute_tensor(torch.ones(6, 4), mesh, [Shard(0)])
    known = memory_profiler._known_tensors(net, [])[torch.device("cpu")]
    return (
        known
        == {
            _span(net.weight.to_local()): (PARAMETERS, "weight"),
            _span(net.weight.grad.to_local()): (GRADIENTS, "weight"),
        }
        and _span(net.weight.to_local())[1] - _span(net.weight.to_local())[0] == 3 * 4 * 4
    )


def test_a_dtensor_counts_as_its_local_shard(world2):
    assert world2.run(_dtensor_ranges) == [True, True]


class AdamModel(StepModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class ModelSnapshot:
    """The snapshot the allocator would record around one step of ``model``, on its real (CPU) tensors.

    Before the trace: the parameters and the optimizer state, and the previous step's gradients, which
    the trace frees (after an activation of 1 MiB is allocated: that is the peak); then the new
    gradients are allocated and the activation freed.
    """

    _ACTIVATION = 2**50  # no CPU tensor lives there

    def __init__(self, model: BoringModel) -> None:
        self.model = model
        self.grads_at_start: list[tuple[int, int]] = []

    def on_record(self) -> None:
        self.grads_at_start = [_span(p.grad) for p in self.model.parameters()]

    def __call__(self) -> dict:
        def ev(action: str, span: tuple[int, int], frames: list[dict] = ()) -> dict:
            return {"action": action, "addr": span[0], "size": span[1] - span[0], "frames": list(frames)}

        grads = [_span(p.grad) for p in self.model.parameters()]
        activation = (self._ACTIVATION, self._ACTIVATION + MiB)
        trace = [ev("alloc", activation, _FRAMES_D)]
        trace += [
            ev(action, s) for s in self.grads_at_start for action in ("free_requested", "free_completed")
        ]
        trace += [ev("alloc", s, _FRAMES_C) for s in grads]
        trace += [ev("free_requested", activation), ev("free_completed", activation)]
        optimizer = self.trainer_optimizer()
        states = [_span(s[k]) for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        live = [(s, []) for s in [_span(p) for p in self.model.parameters()] + states] + [
            (s, _FRAMES_C) for s in grads
        ]
        segments = [
            {
                "device": 0,
                "address": start,
                "total_size": end - start,
                "blocks": [{"address": start, "size": end - start, "state": "active_allocated", "frames": f}],
            }
            for (start, end), f in live
        ]
        return {"segments": segments, "device_traces": [trace]}

    def trainer_optimizer(self) -> torch.optim.Optimizer:
        [optimizer] = self.model.trainer.optimizers
        return optimizer


def test_report_of_a_recorded_step_names_what_the_blocks_hold(tmp_path, monkeypatch):
    events: list[tuple] = []
    model = AdamModel(events)
    snapshot = ModelSnapshot(model)
    FakeCuda(snapshot=snapshot, on_record=snapshot.on_record).install(monkeypatch)
    # The model's tensors are on the CPU: they stand for the CUDA tensors of the snapshot's device.
    monkeypatch.setattr(memory_profiler, "_snapshot_device", lambda index: torch.device("cpu"))
    _fit(tmp_path, MemoryProfilerCallback(steps=[2], dirpath=tmp_path, log_peak=False), model, max_steps=3)

    text = (tmp_path / "step_000002.rank00.md").read_text()
    # BoringModel: Linear(32, 2), 64 + 2 float32 = 264 bytes; AdamW keeps two of the same per parameter.
    assert f"peak allocated: 1.00 MiB ({MiB + 4 * 264} bytes), reached at event 0" in text
    breakdown = [line for line in text.splitlines() if line.startswith("| ") and "MiB |" in line][:5]
    assert breakdown == [
        f"| {ACTIVATIONS} | 1.00 MiB | {MiB} | 99.9% |",
        f"| {OPTIMIZER_STATE} | 0.00 MiB | 528 | 0.1% |",
        f"| {GRADIENTS} | 0.00 MiB | 264 | 0.0% |",
        f"| {PARAMETERS} | 0.00 MiB | 264 | 0.0% |",
        f"| total | 1.00 MiB | {MiB + 4 * 264} | 100.0% |",
    ]
    rows = [
        line.split(" | ")[-2:] for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()
    ]
    assert sorted(rows) == sorted(
        [
            [ACTIVATIONS, "`/home/me/project/model.py:50 training_step` |"],
            [OPTIMIZER_STATE, "exp_avg of layer.weight |"],
            [OPTIMIZER_STATE, "exp_avg_sq of layer.weight |"],
            [GRADIENTS, "layer.weight |"],  # the previous step's, known from the start of recording
            [PARAMETERS, "layer.weight |"],
            [OPTIMIZER_STATE, "exp_avg of layer.bias |"],
            [OPTIMIZER_STATE, "exp_avg_sq of layer.bias |"],
            [GRADIENTS, "layer.bias |"],
            [PARAMETERS, "layer.bias |"],
        ]
    )
    assert OTHER not in text
    assert (tmp_path / "step_000002.rank00.png").stat().st_size > 0


def test_without_matplotlib_warns_once_and_writes_everything_but_the_png(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    callback = MemoryProfilerCallback(steps=[1, 3], dirpath=tmp_path, log_peak=False)
    with pytest.warns(UserWarning) as caught:
        _fit(tmp_path, callback, StepModel(fake.events), max_steps=5)

    assert len([w for w in caught if "pip install lightning-cp[report]" in str(w.message)]) == 1
    assert not [w for w in caught if "offline report" in str(w.message)]
    assert _names(tmp_path) == sorted(
        f"step_00000{step}.rank00.{ext}" for step in (1, 3) for ext in ("pickle", "md", "html")
    )
    assert "| total | 10.00 MiB |" in (tmp_path / "step_000001.rank00.md").read_text()


def _ddp_fit(tmp: str, ranks: list[int], dirpaths: list[str]) -> dict:
    """One rank of a real 2-process DDP fit (gloo), with the CUDA calls faked on this rank."""
    rank = torch.distributed.get_rank()
    fake = FakeCuda()
    fake.max_allocated = (rank + 1) * GiB  # rank 1 peaks higher: the logged value is the max over ranks
    callback = MemoryProfilerCallback(steps=[1], ranks=ranks, dirpath=dirpaths[rank])
    trainer = Trainer(
        default_root_dir=tmp,
        max_steps=3,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[callback],
        limit_val_batches=0,
    )
    with pytest.MonkeyPatch.context() as mp:
        fake.install(mp)
        try:
            trainer.fit(StepModel(fake.events))
        except MisconfigurationException as err:
            return {"error": str(err), "events": fake.events}
    return {
        "events": fake.events,
        "peak_allocated_gib": trainer.callback_metrics["memory/peak_allocated_gib"].item(),
        "files": _names(Path(dirpaths[rank])),
    }


def test_ddp_records_on_selected_ranks_and_logs_the_max_over_ranks(tmp_path, world2):
    snaps = str(tmp_path / "snaps")
    results = world2.run(_ddp_fit, str(tmp_path), [1], [snaps, snaps])

    assert [r["peak_allocated_gib"] for r in results] == [2.0, 2.0]
    assert [e for e in results[0]["events"] if e[0] in ("record", "snapshot")] == []
    assert [e for e in results[1]["events"] if e[0] in ("record", "snapshot")] == [
        ("record", "all"),
        ("snapshot",),
        ("record", None),
    ]
    assert _stems(Path(snaps)) == {"step_000001.rank01.dp1-cp0-tp0"}  # plain DDP: dp = world size


def test_ddp_unwritable_dirpath_on_one_rank_fails_setup_on_every_rank(tmp_path, world2):
    (tmp_path / "a_file").write_text("")
    results = world2.run(
        _ddp_fit, str(tmp_path), [0, 1], [str(tmp_path / "ok"), str(tmp_path / "a_file" / "snaps")]
    )

    assert "cannot be written on another rank" in results[0]["error"]
    assert "a_file/snaps" in results[1]["error"] and "cannot be written on rank 1" in results[1]["error"]
    assert [r["events"] for r in results] == [[], []]  # neither rank reached a training step
