"""The per-step peaks the callback logs: CUDA's, reset every batch, or the process's peak RSS."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from lightning_cp.callbacks import MemoryProfilerCallback
from tests._trainer import quiet_trainer
from tests.callbacks._fake_cuda import (
    FakeCuda,
    GiB,
    MiB,
    StepModel,
    fit,
)


def test_log_peak_logs_cuda_peaks_and_resets_them_every_batch(tmp_path, monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    trainer = fit(tmp_path, MemoryProfilerCallback(dump_on_oom=False), StepModel(fake.events), max_steps=3)

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
        trainer = quiet_trainer(
            default_root_dir=tmp_path, max_steps=6, callbacks=[callback], limit_val_batches=0
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
