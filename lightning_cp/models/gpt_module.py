"""``GPTModule``: the small GPT as a ``LightningModule`` trained with the CP-local fused loss."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_cp.constants import CP_SHARD, INPUT_IDS, POSITION_IDS
from lightning_cp.loss import CPLossMixin
from lightning_cp.memory import tile_model
from lightning_cp.models.gpt import GPT, GPTConfig


class GPTModule(CPLossMixin, LightningModule):
    """A GPT decoder trained on next-token prediction, ready for :class:`~lightning_cp.MegatronCPStrategy`.

    The LM head is never materialized as ``[tokens, vocab]`` logits: the hidden states and the head
    weight go to :meth:`~lightning_cp.CPLossMixin.lm_loss`, which fuses the matmul with the loss and
    logs the metrics listed there.

    Args:
        config: model sizes (``vocab_size`` must cover the data's token ids).
        tiled: run the MLPs and norms over sequence tiles, saving only their inputs, and let the projections
            that read a norm recompute its output instead of saving it
            (:func:`~lightning_cp.memory.tile_model`; exact): the ``+tiled`` of ``lightning-cp plan``.
        lr: peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up from 0 to ``lr`` over this many optimizer steps (0: none).
        chunk_size: tokens per chunk of the fused loss (``None``: automatic).
    """

    def __init__(
        self,
        config: GPTConfig = GPTConfig(),  # noqa: B008 (frozen: one shared default is safe)
        tiled: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(config)
        if tiled:
            tile_model(self.model)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        """Hidden states ``[B, S_local, n_embd]`` of this rank's tokens of a sharded batch."""
        return self.model(batch[INPUT_IDS], batch[POSITION_IDS], cp_shard=batch.get(CP_SHARD))

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        return self.lm_loss(self(batch), self.model.lm_head_weight, batch, chunk_size=self.hparams.chunk_size)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Log-probability of every next token of this rank's shard (0 where there is no target)."""
        return self.lm_token_logprobs(self(batch), self.model.lm_head_weight, batch)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, betas=(0.9, 0.95)
        )
        warmup = max(1, self.hparams.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
