"""An existing plain Lightning project that adds ``MemoryProfilerCallback`` with one line.

Nothing else here uses lightning-cp: a small regression ``LightningModule`` and a ``DataLoader``.

Run it::

    python examples/memory_profiler_existing_project.py

On a GPU this writes, under ``lightning_logs/version_*/memory_snapshots/``:

- ``step_000002.rank00.{pickle,png,md,html}``: step 2 alone;
- ``step_000005-000007.rank00.{pickle,png,md,html}``: steps 5 to 7 in one recording;

Open the ``.png`` and ``.md`` anywhere (the ``.md`` table lists the largest allocations at the peak
with their stacks); drag the ``.pickle`` onto https://pytorch.org/memory_viz when online. The logger
gets ``memory/peak_allocated_gib`` and ``memory/peak_reserved_gib`` for every step.

On a machine without CUDA it trains all the same, warns once that snapshots need CUDA, and logs
``memory/peak_rss_gib`` instead.

In a project that uses LightningCLI, the same line is a flag::

    --trainer.callbacks+=lightning_cp.callbacks.MemoryProfilerCallback --trainer.callbacks.steps='[2, "5-7"]'
"""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_cp.callbacks import MemoryProfilerCallback


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    pl.seed_everything(0)
    x = torch.randn(1024, 64)
    y = x[:, :8].sum(dim=-1)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    trainer = pl.Trainer(
        max_steps=10,
        log_every_n_steps=1,
        enable_progress_bar=False,
        callbacks=[MemoryProfilerCallback(steps=[2, "5-7"])],  # the one added line
    )
    trainer.fit(Regressor(), loader)


if __name__ == "__main__":
    main()
