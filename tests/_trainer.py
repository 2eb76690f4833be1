"""The ``Trainer`` of the tests: quiet (no logger, checkpoints, progress bar, model summary or sanity check)
on the CPU, alone or under ``MegatronCPStrategy`` over the running process group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Trainer

from lightning_cp import MegatronCPStrategy


def quiet_trainer(**options: Any) -> Trainer:
    """A ``Trainer`` on one CPU process that prints and writes nothing by itself; ``options`` override."""
    defaults = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return Trainer(**{**defaults, **options})


def cp_trainer(cp: int, devices: int | None = None, **options: Any) -> Trainer:
    """:func:`quiet_trainer` under ``MegatronCPStrategy(cp=cp)`` (unless ``options`` has a ``strategy``) on
    ``devices`` CPU processes, by default every rank of the running process group."""
    if "strategy" not in options:
        options["strategy"] = MegatronCPStrategy(cp=cp)
    return quiet_trainer(devices=dist.get_world_size() if devices is None else devices, **options)
