"""The checkpoint a command starts from: ``ckpt_path: last`` resolved, read cheaply, checked against the config.

Every check here runs in the command's first process, after the classes are built and before the trainer
method, hence before Lightning starts the other ranks: a mistake costs one line, not a traceback per rank.

- :func:`last_checkpoint` finds the newest ``last*.ckpt`` (file or sharded FSDP folder) of the run name.
- :func:`read_checkpoint` reads what a checkpoint says about itself (hyperparameters, step) without its
  weights (:mod:`lightning_cp.checkpoint_format`, the one reader of the format).
- :func:`differences` lists where the checkpoint's model or data hyperparameters differ from the
  configuration's (model class, model config, data vocabulary): those would be loaded into a model they do
  not fit, or (Lightning's ``LightningCLI`` behaviour, which the package's CLI turns off) silently replace
  the configuration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_cp.checkpoint_format import UnreadableCheckpoint, open_checkpoint
from lightning_cp.cli.parse_errors import ConfigurationError
from lightning_cp.strategies import MegatronCPFSDPStrategy
from lightning_cp.strategies.epoch_position import finished_epochs

_DATA_KEYS = ("vocab_size",)
"""Data module hyperparameters that must match the checkpoint's: another vocabulary trains another task."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint says about itself, read without its tensors."""

    path: Path
    sharded: bool
    """A folder written by ``MegatronCPFSDPStrategy`` (``meta.pt`` and DCP shards) rather than one file."""
    global_step: int
    """Optimizer steps taken when it was saved."""
    finished_epochs: int
    """Training epochs run to their last batch when it was saved (what ``max_epochs`` is compared with)."""
    model: dict[str, Any]
    """The model's hyperparameters (``_class_path`` included when the ``lightning-cp`` command saved it)."""
    data: dict[str, Any]
    """The data module's hyperparameters, ``{}`` when it saved none."""


def last_checkpoint_search(trainer: Trainer) -> tuple[Path, str] | None:
    """Where ``ckpt_path: last`` looks: ``(folder, glob pattern)``, else ``None`` (no ``ModelCheckpoint``).

    With a ``ModelCheckpoint`` ``dirpath``, that folder; otherwise ``<save_dir>/<name>/version_*/checkpoints``
    of the first logger (every run logs to a new ``version_N``, so the previous versions are searched too).
    ``None`` too without ``dirpath`` and without a logger.
    """
    checkpoint = trainer.checkpoint_callback
    if not isinstance(checkpoint, ModelCheckpoint):
        return None
    pattern = f"{checkpoint.CHECKPOINT_NAME_LAST}*{checkpoint.FILE_EXTENSION}"
    if checkpoint.dirpath is not None:
        return Path(checkpoint.dirpath), pattern
    if not trainer.loggers:
        return None
    logger = trainer.loggers[0]
    run = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name or "")
    return run, f"version_*/checkpoints/{pattern}"


def last_checkpoint(trainer: Trainer) -> Path | None:
    """The newest ``last*`` checkpoint (file or FSDP folder) of :func:`last_checkpoint_search`, else ``None``."""
    search = last_checkpoint_search(trainer)
    candidates = [] if search is None else list(search[0].glob(search[1]))
    return max(candidates, key=lambda path: path.stat().st_mtime) if candidates else None


def read_checkpoint(path: Path, trainer: Trainer) -> CheckpointInfo:
    """Read ``path``'s hyperparameters and step without loading its tensors
    (:func:`~lightning_cp.checkpoint_format.open_checkpoint`).

    Raises:
        ConfigurationError: ``path`` does not exist, is not a readable checkpoint (truncated, another
            format), or is a sharded FSDP folder while the trainer's strategy does not shard.
    """
    if path.is_dir() and not isinstance(trainer.strategy, MegatronCPFSDPStrategy):
        raise ConfigurationError(
            f"ckpt_path: {str(path)!r} is a sharded FSDP checkpoint folder and trainer.strategy does not "
            "shard: set trainer.strategy.class_path: lightning_cp.MegatronCPFSDPStrategy, or consolidate it "
            "into one file with lightning_cp.strategies.consolidate_checkpoint(folder, 'model.ckpt') and give "
            "that file."
        )
    try:
        checkpoint = open_checkpoint(path, tensors=False)
    except UnreadableCheckpoint as error:
        raise ConfigurationError(f"ckpt_path: {error}.") from error
    return CheckpointInfo(
        path=path,
        sharded=checkpoint.sharded,
        global_step=checkpoint.global_step,
        finished_epochs=finished_epochs(checkpoint.metadata),
        model=checkpoint.hyper_parameters,
        data=checkpoint.datamodule_hyper_parameters,
    )


def differences(
    info: CheckpointInfo, model: LightningModule, datamodule: LightningDataModule | None
) -> list[str]:
    """Where ``info``'s model class, model config or data vocabulary differ from the configuration's.

    Each difference reads ``"model.init_args.config.n_embd: 128 in the checkpoint, 256 in the configuration"``.
    Other hyperparameters (learning rate, warm-up, batch size, ...) may change between runs and are not
    compared. A key that only one side records (a default left out of a config dict) is not compared.
    """
    found = []
    saved_class = info.model.get("_class_path")
    configured_class = model.hparams.get(
        "_class_path", f"{type(model).__module__}.{type(model).__qualname__}"
    )
    if saved_class is not None and not _same_class(saved_class, type(model)):
        found.append(f"model: {saved_class} in the checkpoint, {configured_class} in the configuration")
        return found  # another class: its hyperparameters are not comparable
    saved_config, configured_config = info.model.get("config"), model.hparams.get("config")
    if saved_config is not None and configured_config is not None:
        saved, configured = _flat(saved_config), _flat(configured_config)
        found += [
            f"model.init_args.config{key}: {_show(saved[key])} in the checkpoint, "
            f"{_show(configured[key])} in the configuration"
            for key in sorted(saved.keys() & configured.keys())
            if saved[key] != configured[key]
        ]
    data_hparams = getattr(datamodule, "hparams", {}) if datamodule is not None else {}
    for key in _DATA_KEYS:
        if key in info.data and key in data_hparams and info.data[key] != data_hparams[key]:
            found.append(
                f"data.init_args.{key}: {_show(info.data[key])} in the checkpoint, "
                f"{_show(data_hparams[key])} in the configuration"
            )
    return found


def _same_class(class_path: str, cls: type) -> bool:
    """Whether ``class_path`` names ``cls``, also through a re-export (``lightning_cp.models.GPTModule``)."""
    module, _, name = class_path.rpartition(".")
    return name == cls.__qualname__ and (module == cls.__module__ or cls.__module__.startswith(f"{module}."))


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config (dict, dataclass, transformers config) as ``{".key.sub": leaf}``; a leaf as ``{"": x}``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    elif hasattr(value, "to_dict") and callable(value.to_dict):
        value = value.to_dict()
    if isinstance(value, Mapping):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flat(item, f"{prefix}.{key}"))
        return flat
    return {prefix: list(value) if isinstance(value, tuple) else value}


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
