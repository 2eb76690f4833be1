"""Callbacks for the tests' ``lightning-cp fit`` runs: a rank that dies after a step, ranks held in setup, a
rank that calls the model outside the step alone."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
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


class HoldInSetup(Callback):
    """Every rank writes its pid to ``<folder>/setup-<rank>`` in ``setup`` (the process group is up, no signal
    handler of Lightning's yet), then waits there ``seconds``."""

    def __init__(self, folder: str, seconds: float) -> None:
        self.folder = Path(folder)
        self.seconds = seconds

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        (self.folder / f"setup-{trainer.global_rank}").write_text(str(os.getpid()))
        time.sleep(self.seconds)


class CallOnOneRank(Callback):
    """Rank ``rank`` alone calls the model outside the step after step ``step`` (the mistake
    ``MegatronCPFSDPStrategy`` refuses), having shortened the strategy's wait for the others to
    ``timeout_s``; the other ranks go on to the next step."""

    def __init__(self, rank: int, step: int, timeout_s: float) -> None:
        self.rank = rank
        self.step = step
        self.timeout_s = timeout_s

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy._outside_calls.timeout_s = self.timeout_s

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: object, batch: dict, *args: object
    ) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        with torch.no_grad():
            pl_module.model(batch["input_ids"], batch["position_ids"])
