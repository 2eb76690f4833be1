"""The checkpoint a command starts from: ``ckpt_path: last`` resolved, read cheaply, checked against the config.

Every check here runs in the command's first process, after the classes are built and before the trainer
method, hence before Lightning starts the other ranks: a mistake costs one line, not a traceback per rank.

- :func:`last_checkpoint` finds the newest ``last*.ckpt`` (file or sharded FSDP folder) of the run name.
- :func:`read_checkpoint` reads what a checkpoint says about itself (hyperparameters, step) without its
  weights: the ``torch.save`` zip memory-mapped, or an FSDP folder's ``meta.pt``.
- :func:`differences` lists where the checkpoint's model or data hyperparameters differ from the
  configuration's (model class, model config, data vocabulary): those would be loaded into a model they do
  not fit, or (Lightning's ``LightningCLI`` behaviour, which the package's CLI turns off) silently replace
  the configuration.
"""

from __future__ import annotations

import dataclasses
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_cp.cli.parse_errors import ConfigurationError
from lightning_cp.strategies import MegatronCPFSDPStrategy

FSDP_METADATA = "meta.pt"
"""The file of a sharded (``MegatronCPFSDPStrategy``) checkpoint folder that holds everything but the tensors."""

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
    """Read ``path``'s hyperparameters and step without loading its tensors (memory-mapped).

    Raises:
        ConfigurationError: ``path`` does not exist, is not a readable checkpoint (truncated, another
            format), or is a sharded FSDP folder while the trainer's strategy does not shard.
    """
    if not path.exists():
        raise ConfigurationError(f"ckpt_path: {str(path)!r} does not exist. Give an existing checkpoint.")
    sharded = path.is_dir()
    if sharded and not isinstance(trainer.strategy, MegatronCPFSDPStrategy):
        raise ConfigurationError(
            f"ckpt_path: {str(path)!r} is a sharded FSDP checkpoint folder and trainer.strategy does not "
            "shard: set trainer.strategy.init_args.fsdp: true, or consolidate it into one file with "
            "lightning_cp.strategies.consolidate_checkpoint(folder, 'model.ckpt') and give that file."
        )
    file = path / FSDP_METADATA if sharded else path
    try:
        # weights_only=False: a checkpoint's hyperparameters may hold dataclasses such as GPTConfig. The
        # file is the one the trainer is about to load in full.
        checkpoint = torch.load(file, map_location="cpu", mmap=not sharded, weights_only=False)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        reason = (
            str(error).strip().split(". ")[0].splitlines()[0] if str(error).strip() else type(error).__name__
        )
        raise ConfigurationError(
            f"ckpt_path: {str(file)!r} is not a readable checkpoint ({reason}): it may be truncated (a "
            "copy or a save that did not finish) or not written by torch.save. Give another checkpoint."
        ) from error
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint and not sharded:
        raise ConfigurationError(
            f"ckpt_path: {str(file)!r} is not a Lightning checkpoint (no 'state_dict'). Give a file written by "
            "the trainer (last.ckpt, or one of ModelCheckpoint's)."
        )
    return CheckpointInfo(
        path=path,
        sharded=sharded,
        global_step=int(checkpoint.get("global_step", 0)),
        model=dict(checkpoint.get("hyper_parameters") or {}),
        data=dict(checkpoint.get("datamodule_hyper_parameters") or {}),
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
