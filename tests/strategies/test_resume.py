"""Resuming mid-epoch from a checkpoint follows the uninterrupted run exactly; checkpoint files are atomic."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_cp.data import LongRangeDataModule
from lightning_cp.models import GPTConfig, GPTModule
from lightning_cp.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_cp.strategies.epoch_position import finished_epochs
from tests._trainer import cp_trainer

STEPS, RESUME_AT = 6, 3  # an epoch of 12 batches: the checkpoint is mid-epoch


class _Losses(Callback):
    def __init__(self):
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()


def _fit(
    cp: int,
    directory: str,
    ckpt_path: str | None = None,
    steps: int = STEPS,
    checkpoint: ModelCheckpoint | None = None,
) -> dict[int, float]:
    seed_everything(0)
    module = GPTModule(GPTConfig(vocab_size=32, n_layer=1, n_head=2, n_embd=16), lr=1e-2)
    data = LongRangeDataModule(
        vocab_size=32, seq_len=16, num_train_samples=48, num_val_samples=4, batch_size=2
    )
    losses = _Losses()
    trainer = cp_trainer(
        cp,
        max_steps=steps,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[
            losses,
            checkpoint or ModelCheckpoint(dirpath=directory, every_n_train_steps=RESUME_AT, save_top_k=-1),
        ],
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return losses.losses


def _interrupted_and_resumed(cp: int, directory: str) -> tuple[dict[int, float], dict[int, float]]:
    uninterrupted = _fit(cp, os.path.join(directory, f"cp{cp}"))
    resumed = _fit(
        cp,
        os.path.join(directory, f"cp{cp}-resumed"),
        os.path.join(directory, f"cp{cp}", "epoch=0-step=3.ckpt"),
    )
    return uninterrupted, resumed


@pytest.mark.parametrize("cp", [1, 2])
def test_resuming_mid_epoch_continues_with_the_next_batches(world2, tmp_path, cp):
    # cp = 1: dp = 2, the DistributedSampler splits the epoch; cp = 2: both ranks read the same batches.
    uninterrupted, resumed = world2.run(_interrupted_and_resumed, cp, str(tmp_path))[0]
    assert sorted(resumed) == list(range(RESUME_AT + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6, abs=0), f"step {step}"


def _stopped_and_extended(directory: str, on_train_epoch_end: bool) -> dict[int, float]:
    """A run of RESUME_AT steps whose ``last.ckpt`` is saved when it ends (from ``on_train_epoch_end``, or
    ``on_train_end``), then the same run extended to STEPS from it."""

    def last() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=directory, save_last=True, save_on_train_epoch_end=on_train_epoch_end)

    _fit(2, directory, steps=RESUME_AT, checkpoint=last())
    stopped = torch.load(os.path.join(directory, "last.ckpt"), weights_only=False)
    assert finished_epochs(stopped) == 0  # what the CLI compares with max_epochs
    return _fit(2, directory, os.path.join(directory, "last.ckpt"), checkpoint=last())


@pytest.mark.parametrize("on_train_epoch_end", [True, False], ids=["epoch-end-hook", "train-end-hook"])
def test_extending_a_finished_run_continues_its_epoch(world2, tmp_path, on_train_epoch_end):
    # Lightning counts the epoch a max_steps stop ended as processed: resumed as is, the run started the next
    # epoch (another sampler order) and never saw the rest of the first.
    uninterrupted = world2.run(_fit, 2, str(tmp_path / "uninterrupted"))[0]
    extended = world2.run(_stopped_and_extended, str(tmp_path / "extended"), on_train_epoch_end)[0]
    assert sorted(extended) == list(range(RESUME_AT + 1, STEPS + 1))
    for step, loss in extended.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6, abs=0), f"step {step}"


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_partial_file(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    real_save = torch.save

    def disk_full(obj, file, *args, **kwargs):
        real_save(obj, file, *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        io.save_checkpoint({"step": 2}, path)
    assert os.listdir(tmp_path) == ["last.ckpt"]
    assert io.load_checkpoint(path) == {"step": 1}


def _small_filesystem() -> Path:
    """A 256 KiB tmpfs, or skip (needs root and a kernel that lets this container mount)."""
    directory = Path(tempfile.mkdtemp())
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(directory)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        directory.rmdir()
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    return directory


def test_a_full_disk_never_leaves_a_truncated_checkpoint():
    # Lightning's TorchCheckpointIO fails this: it copies a temporary file from /tmp, truncated at the full
    # disk, to epoch=0-step=100.ckpt, and over the previous last.ckpt.
    io = AtomicCheckpointIO()
    directory = _small_filesystem()
    try:
        io.save_checkpoint({"w": torch.zeros(1000)}, directory / "last.ckpt")
        for name in ("epoch=0-step=100.ckpt", "last.ckpt"):  # a new file, then over the previous one
            with pytest.raises((OSError, RuntimeError)):  # torch's zip writer may re-raise as RuntimeError
                io.save_checkpoint({"w": torch.zeros(100_000)}, directory / name)
        assert sorted(os.listdir(directory)) == ["last.ckpt"]
        assert io.load_checkpoint(directory / "last.ckpt")["w"].shape == (1000,)
    finally:
        subprocess.run(["umount", str(directory)], check=False)
        shutil.rmtree(directory, ignore_errors=True)
