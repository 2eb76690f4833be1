"""What the command reads from a checkpoint before it starts any rank: errors, and differences from the config.

The checkpoints here are written with ``torch.save`` in the layout Lightning uses (``state_dict``,
``global_step``, ``hyper_parameters`` with the CLI's ``_class_path``, ``datamodule_hyper_parameters``);
``tests/test_cli.py`` runs the same checks on checkpoints a real ``fit`` wrote.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy
from lightning_cp.cli.checkpoints import differences, last_checkpoint, read_checkpoint
from lightning_cp.cli.parse_errors import ConfigurationError
from lightning_cp.data import LongRangeDataModule
from lightning_cp.models import GPTConfig, GPTModule

CONFIG = {"vocab_size": 64, "n_layer": 1, "n_head": 2, "n_embd": 16}


def _trainer(fsdp: bool = False) -> Trainer:
    strategy = MegatronCPFSDPStrategy(cp=1) if fsdp else MegatronCPStrategy(cp=1)
    return Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, max_steps=1)


def _save(path: Path, config: dict | GPTConfig = CONFIG, data_vocab: int = 64, **extra) -> Path:
    hparams = {"_class_path": "lightning_cp.models.GPTModule", "config": config, "lr": 1e-3, **extra}
    checkpoint = {
        "state_dict": {},
        "global_step": 7,
        "hyper_parameters": hparams,
        "datamodule_hyper_parameters": {"vocab_size": data_vocab, "seq_len": 16},
    }
    torch.save(checkpoint, path)
    return path


def _model(**config) -> GPTModule:
    model = GPTModule(config=GPTConfig(**{**CONFIG, **config}))
    model.hparams["_class_path"] = "lightning_cp.models.GPTModule"  # as the CLI's instantiator records it
    return model


def _data(vocab_size: int = 64) -> LongRangeDataModule:
    return LongRangeDataModule(vocab_size=vocab_size, seq_len=16, num_train_samples=4, num_val_samples=2)


def test_a_checkpoint_of_the_configured_model_has_no_differences(tmp_path):
    info = read_checkpoint(_save(tmp_path / "a.ckpt", lr=0.5), _trainer())
    assert (info.global_step, info.sharded) == (7, False)
    assert differences(info, _model(), _data()) == []  # another learning rate is no difference


def test_every_differing_size_and_the_data_vocabulary_are_listed(tmp_path):
    info = read_checkpoint(_save(tmp_path / "a.ckpt", data_vocab=32), _trainer())
    found = differences(info, _model(n_embd=32, vocab_size=128), _data(vocab_size=64))
    assert found == [
        "model.init_args.config.n_embd: 16 in the checkpoint, 32 in the configuration",
        "model.init_args.config.vocab_size: 64 in the checkpoint, 128 in the configuration",
        "data.init_args.vocab_size: 32 in the checkpoint, 64 in the configuration",
    ]


def test_a_dataclass_config_compares_by_its_fields(tmp_path):
    info = read_checkpoint(_save(tmp_path / "a.ckpt", config=GPTConfig(**CONFIG)), _trainer())
    assert differences(info, _model(), _data()) == []
    assert differences(info, _model(n_head=4), _data()) == [
        "model.init_args.config.n_head: 2 in the checkpoint, 4 in the configuration"
    ]


def test_another_model_class_is_one_difference(tmp_path):
    info = read_checkpoint(
        _save(tmp_path / "a.ckpt", _class_path="lightning_cp.models.HFCausalLM"), _trainer()
    )
    assert differences(info, _model(), _data()) == [
        "model: lightning_cp.models.HFCausalLM in the checkpoint, lightning_cp.models.GPTModule in the configuration"
    ]


@pytest.mark.parametrize(
    "case", ["missing", "truncated", "not-torch", "not-lightning", "fsdp-folder-with-ddp"]
)
def test_unusable_checkpoints_are_refused_with_the_fix(case, tmp_path):
    path = tmp_path / "last.ckpt"
    if case == "truncated":
        whole = _save(tmp_path / "whole.ckpt").read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    elif case == "not-torch":
        path.write_text("hello")
    elif case == "not-lightning":
        torch.save({"weights": torch.zeros(2)}, path)
    elif case == "fsdp-folder-with-ddp":
        path.mkdir()
        torch.save({"global_step": 3}, path / "meta.pt")
    expected = {
        "missing": "does not exist",
        "truncated": "is not a readable checkpoint (PytorchStreamReader failed",
        "not-torch": "is not a readable checkpoint",
        "not-lightning": "is not a Lightning checkpoint (no 'state_dict')",
        "fsdp-folder-with-ddp": "class_path: lightning_cp.MegatronCPFSDPStrategy, or consolidate it",
    }[case]
    with pytest.raises(ConfigurationError, match=r"^ckpt_path: '.*last.ckpt'") as error:
        read_checkpoint(path, _trainer())
    assert expected in str(error.value)
    assert "\n" not in str(error.value)


def test_a_sharded_folder_is_read_from_its_metadata_with_fsdp(tmp_path):
    path = tmp_path / "last.ckpt"
    path.mkdir()
    torch.save({"global_step": 3, "hyper_parameters": {"config": CONFIG}}, path / "meta.pt")
    info = read_checkpoint(path, _trainer(fsdp=True))
    assert (info.global_step, info.sharded, info.model["config"]) == (3, True, CONFIG)


def _last_candidate(path: Path, mtime: float, folder: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        path.mkdir()
        torch.save({"global_step": 1}, path / "meta.pt")
    else:
        _save(path)
    os.utime(path, (mtime, mtime))
    return path


def test_last_is_the_newest_of_several_candidates_in_the_checkpoint_folder(tmp_path):
    """ModelCheckpoint's versioned names (``last-v1``) and an FSDP folder: whichever was written last, whatever
    its name or its place in the folder's listing."""
    folder = tmp_path / "checkpoints"
    candidates = [
        _last_candidate(folder / "last.ckpt", 1_000),
        _last_candidate(folder / "last-v1.ckpt", 1_000),
        _last_candidate(folder / "last-v2.ckpt", 1_000, folder=True),
    ]
    _last_candidate(folder / "epoch=0-step=9.ckpt", 9_000)  # not a last checkpoint
    trainer = Trainer(
        accelerator="cpu", logger=False, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)]
    )
    for newest in candidates:
        for path in candidates:
            os.utime(path, (2_000, 2_000) if path == newest else (1_000, 1_000))
        assert last_checkpoint(trainer) == newest


def test_last_is_the_newest_of_the_run_s_versions(tmp_path):
    """Without a dirpath, every ``version_N/checkpoints`` of the logger's run name; another name is not searched."""
    run = tmp_path / "csv"
    newest = _last_candidate(run / "version_0" / "checkpoints" / "last.ckpt", 5_000)
    _last_candidate(run / "version_1" / "checkpoints" / "last.ckpt", 4_000)
    _last_candidate(run / "version_2" / "checkpoints" / "last.ckpt", 3_000, folder=True)
    _last_candidate(tmp_path / "other" / "version_0" / "checkpoints" / "last.ckpt", 6_000)
    trainer = Trainer(accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"))
    assert last_checkpoint(trainer) == newest
