"""``MemoryProfilerCallback`` on a real CUDA device: real snapshots, the real OOM observer."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_cp.callbacks import MemoryProfilerCallback
from lightning_cp.callbacks.memory import tensors, timeline
from tests._trainer import quiet_trainer

pytestmark = pytest.mark.gpu


class _MLP(LightningModule):
    """Big enough that a step allocates tens of MiB, so the peak is well above allocator rounding."""

    def __init__(self, oom_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
        )
        self.oom_at = oom_at

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.oom_at:
            torch.empty(2**46, dtype=torch.uint8, device=self.device)  # 64 TiB: no GPU has it
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64 * 8, 1024)), batch_size=64)


class _PeakProbe(Callback):
    """Reads ``torch.cuda.max_memory_allocated`` over one step, independently of the profiler."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.peak: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1:
            self.peak = torch.cuda.max_memory_allocated()


def test_real_snapshot_peak_matches_max_memory_allocated(tmp_path):
    probe = _PeakProbe(step=2)
    profiler = MemoryProfilerCallback(steps=[2], dirpath=tmp_path, log_peak=False)
    quiet_trainer(
        accelerator="cuda", default_root_dir=tmp_path, max_steps=4, callbacks=[profiler, probe]
    ).fit(_MLP())

    stem = tmp_path / "step_000002.rank00"
    for ext in ("png", "md", "html"):
        assert stem.with_name(f"{stem.name}.{ext}").stat().st_size > 0
    with open(stem.with_name(f"{stem.name}.pickle"), "rb") as f:
        snapshot = pickle.load(f)
    device = timeline.busiest_device(snapshot)
    assert device == torch.cuda.current_device()
    peak = timeline.analyze(snapshot, device).peak_bytes
    assert probe.peak is not None and probe.peak > 16 * 2**20
    assert peak == pytest.approx(probe.peak, rel=0.03)


def test_real_oom_is_dumped_by_the_observer_before_it_propagates(tmp_path):
    profiler = MemoryProfilerCallback(steps=None, dirpath=tmp_path, log_peak=False)
    with pytest.raises(torch.OutOfMemoryError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer(accelerator="cuda", default_root_dir=tmp_path, max_steps=4, callbacks=[profiler]).fit(
            _MLP(oom_at=1)
        )

    with open(tmp_path / "oom_step_000001.rank00.pickle", "rb") as f:
        snapshot = pickle.load(f)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    assert [e["size"] for e in trace if e["action"] == "oom"][-1] >= 2**46
    assert "OOM at event" in (tmp_path / "oom_step_000001.rank00.md").read_text()


def _peak_by_category(markdown: str) -> dict[str, int]:
    """``{category: bytes}`` from the report's "The peak by category" table."""
    section = markdown.split("## The peak by category\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split(" | ") for line in section.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): int(cells[2]) for cells in rows[1:]}  # rows[0] is the header


def test_real_snapshot_breaks_the_peak_down_by_what_the_blocks_hold(tmp_path):
    model = _MLP()
    profiler = MemoryProfilerCallback(steps=[2], dirpath=tmp_path, log_peak=False)
    quiet_trainer(accelerator="cuda", default_root_dir=tmp_path, max_steps=4, callbacks=[profiler]).fit(model)

    text = (tmp_path / "step_000002.rank00.md").read_text()
    peak = _peak_by_category(text)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # A block may exceed its request by less than 1 MiB (the allocator does not split off smaller
    # remainders); there are 4 parameters, 4 gradients, and AdamW's exp_avg and exp_avg_sq of each.
    slack = 2**20
    assert params <= peak[tensors.PARAMETERS] < params + 4 * slack
    assert 2 * params <= peak[tensors.OPTIMIZER_STATE] < 2 * params + 8 * slack
    # zero_grad frees the previous step's gradients before backward makes new ones: one set at any time.
    assert params <= peak[tensors.GRADIENTS] < params + 4 * slack
    assert peak["total"] == sum(n for category, n in peak.items() if category != "total")
    for name in ("net.0.weight", "net.2.weight"):
        assert f"| {tensors.PARAMETERS} | {name}" in text
        assert f"exp_avg of {name}" in text
