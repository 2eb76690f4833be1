"""One rank of a two-node run, as ``torchrun`` starts it on each node: ``python -m tests.strategies._two_nodes OUT``.

Every rank trains the small GPT for a few steps under ``MegatronCPStrategy(cp=2)`` with
``Trainer(num_nodes=2, devices=2)`` and writes ``OUT/rank<R>.json``: its node, its CP and DP groups' global
ranks and its step losses. :func:`fit` is also what the one-node reference runs on a pool of 4 ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch import Callback, seed_everything
from torch.utils.data import DataLoader

from lightning_cp import MegatronCPStrategy
from lightning_cp.data import LongRangeCopyDataset, collate_padded
from lightning_cp.models import GPTConfig, GPTModule
from tests._trainer import quiet_trainer


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(outputs["loss"].item())


def fit(num_nodes: int, devices: int) -> dict:
    """Train 3 steps at dp 2 x cp 2; this rank's groups and losses."""
    seed_everything(0)
    module = GPTModule(GPTConfig(vocab_size=32, n_layer=1, n_head=2, n_embd=16), lr=1e-2)
    data = LongRangeCopyDataset(num_samples=12, seq_len=16, vocab_size=32, seed=3)
    losses = _Losses()
    strategy = MegatronCPStrategy(cp=2)
    trainer = quiet_trainer(
        num_nodes=num_nodes, devices=devices, strategy=strategy, max_steps=3, callbacks=[losses]
    )
    groups = {}

    class _Groups(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            layout = trainer.strategy.layout
            groups["cp"] = dist.get_process_group_ranks(layout.cp_group)
            groups["dp"] = dist.get_process_group_ranks(layout.dp_group)

    trainer.callbacks.append(_Groups())
    trainer.fit(module, DataLoader(data, batch_size=2, collate_fn=collate_padded))
    return {"rank": dist.get_rank(), **groups, "losses": losses.losses}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    result = {**fit(num_nodes=2, devices=2), "node": int(os.environ["GROUP_RANK"])}
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))
