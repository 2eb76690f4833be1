"""``ResumableDataLoader``: the position it checkpoints, and the batches a resumed run trains on."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_cp.data import ResumableDataLoader
from tests._trainer import quiet_trainer


def test_loader_position_skips_index_batches_without_loading_them():
    loaded = []
    dataset = [torch.tensor(i) for i in range(10)]

    class Recording(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            loaded.append(i)
            return dataset[i]

    loader = ResumableDataLoader(Recording(), batch_size=3)
    iterator = iter(loader)
    next(iterator), next(iterator)
    assert loader.state_dict() == {"batches": 2}
    fresh = ResumableDataLoader(Recording(), batch_size=3)
    fresh.load_state_dict(loader.state_dict())
    loaded.clear()
    assert [batch.tolist() for batch in fresh] == [[6, 7, 8], [9]]
    assert loaded == [6, 7, 8, 9] and len(fresh) == 4
    assert next(iter(fresh)).tolist() == [0, 1, 2]  # the next epoch starts from the beginning
    with pytest.raises(ValueError, match="5 batches"):
        fresh.load_state_dict({"batches": 5})


def test_a_resumed_loader_counts_on_from_where_it_resumed():
    loader = ResumableDataLoader(torch.arange(10), batch_size=2)
    loader.load_state_dict({"batches": 2})
    iterator = iter(loader)

    assert next(iterator).tolist() == [4, 5]
    assert loader.state_dict() == {"batches": 3}  # the epoch's position, not the batches since the resume
    assert [batch.tolist() for batch in iterator] == [[6, 7], [8, 9]]
    assert loader.state_dict() == {"batches": 5}


class _Recorder(LightningModule):
    """Records the sample ids of every batch it trains on (the weights never change)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.trained: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.trained.append(batch.tolist())
        return self.layer(batch[:, None].float()).sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return ResumableDataLoader(torch.arange(24), batch_size=2)  # an epoch of 12 batches


def _train(directory, max_steps, ckpt_path=None):
    module = _Recorder()
    trainer = quiet_trainer(
        max_steps=max_steps,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module.trained


def test_resuming_twice_in_one_epoch_trains_the_uninterrupted_batches(tmp_path):
    # The second resume reads a checkpoint saved by a resumed run: its position must count the batches
    # before the first resume too.
    uninterrupted = _train(tmp_path / "once", max_steps=6)
    first = _train(tmp_path / "twice", max_steps=2)
    second = _train(tmp_path / "twice", max_steps=4, ckpt_path=tmp_path / "twice" / "epoch=0-step=2.ckpt")
    third = _train(tmp_path / "twice", max_steps=6, ckpt_path=tmp_path / "twice" / "epoch=0-step=4.ckpt")

    assert uninterrupted == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert first + second + third == uninterrupted
