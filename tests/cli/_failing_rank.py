"""A callback for the tests' ``lightning-cp fit`` runs: rank ``rank`` dies after step ``step``."""

from __future__ import annotations

import os
import signal

from lightning.pytorch import Callback, LightningModule, Trainer


class FailRank(Callback):
    """Rank ``rank`` kills itself with SIGKILL (``how="kill"``) or raises a two-line ``ValueError`` (``"raise"``)."""

    def __init__(self, rank: int, step: int, how: str) -> None:
        self.rank = rank
        self.step = step
        self.how = how

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"rank {self.rank} cannot go on\nthe second line")
