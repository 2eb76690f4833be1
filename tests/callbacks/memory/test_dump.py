"""The files of a dump: their names, what is skipped, where they may go, what the report names."""

from __future__ import annotations

import sys

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_cp.callbacks import MemoryProfilerCallback
from lightning_cp.callbacks.memory import dump
from lightning_cp.callbacks.memory.tensors import ACTIVATIONS, GRADIENTS, OPTIMIZER_STATE, OTHER, PARAMETERS
from lightning_cp.parallel import ParallelLayout
from tests.callbacks._fake_cuda import (
    FRAMES_C,
    FRAMES_D,
    FakeCuda,
    MiB,
    StepModel,
    fit,
    names,
    stems,
    storage_span,
)


def test_file_names_carry_the_parallel_layout(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    group = object()  # never called into
    layout = ParallelLayout(
        dp=2, cp=2, rank=3, dp_rank=1, cp_rank=1, cp_group=group, dp_group=group, loss_group=group
    )
    monkeypatch.setattr(dump, "current_layout", lambda: layout)
    fit(tmp_path, MemoryProfilerCallback(steps=[2], log_peak=False), StepModel(fake.events), max_steps=3)

    # dirpath defaults to <trainer.log_dir>/memory_snapshots; with logger=False log_dir is default_root_dir.
    assert stems(tmp_path / "memory_snapshots") == {"step_000002.rank00.dp1-cp1-tp0"}


def test_empty_trace_is_skipped_with_a_warning(tmp_path, monkeypatch):
    fake = FakeCuda(snapshot={"segments": [], "device_traces": [[]]}).install(monkeypatch)
    callback = MemoryProfilerCallback(steps=[1], dirpath=tmp_path, log_peak=False)
    with pytest.warns(UserWarning, match="has no allocator events"):
        fit(tmp_path, callback, StepModel(fake.events), max_steps=3)

    assert ("snapshot",) in fake.events
    assert names(tmp_path) == []


def test_unwritable_dirpath_fails_at_setup(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    (tmp_path / "a_file").write_text("")
    callback = MemoryProfilerCallback(steps=[1], dirpath=tmp_path / "a_file" / "snaps")
    with pytest.raises(MisconfigurationException, match=r"a_file/snaps.*cannot be written on rank 0"):
        fit(tmp_path, callback, StepModel(fake.events))

    assert fake.events == []  # not a single training step ran


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
        self.grads_at_start = [storage_span(p.grad) for p in self.model.parameters()]

    def __call__(self) -> dict:
        def ev(action: str, span: tuple[int, int], frames: list[dict] = ()) -> dict:
            return {"action": action, "addr": span[0], "size": span[1] - span[0], "frames": list(frames)}

        grads = [storage_span(p.grad) for p in self.model.parameters()]
        activation = (self._ACTIVATION, self._ACTIVATION + MiB)
        trace = [ev("alloc", activation, FRAMES_D)]
        trace += [
            ev(action, s) for s in self.grads_at_start for action in ("free_requested", "free_completed")
        ]
        trace += [ev("alloc", s, FRAMES_C) for s in grads]
        trace += [ev("free_requested", activation), ev("free_completed", activation)]
        optimizer = self.trainer_optimizer()
        states = [storage_span(s[k]) for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        live = [(s, []) for s in [storage_span(p) for p in self.model.parameters()] + states] + [
            (s, FRAMES_C) for s in grads
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
    monkeypatch.setattr(dump, "snapshot_device", lambda index: torch.device("cpu"))
    fit(tmp_path, MemoryProfilerCallback(steps=[2], dirpath=tmp_path, log_peak=False), model, max_steps=3)

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
        fit(tmp_path, callback, StepModel(fake.events), max_steps=5)

    assert len([w for w in caught if "pip install lightning-cp[report]" in str(w.message)]) == 1
    assert not [w for w in caught if "offline report" in str(w.message)]
    assert names(tmp_path) == sorted(
        f"step_00000{step}.rank00.{ext}" for step in (1, 3) for ext in ("pickle", "md", "html")
    )
    assert "| total | 10.00 MiB |" in (tmp_path / "step_000001.rank00.md").read_text()
