"""Write the per-token log-probabilities of ``predict`` to files, full sequences reassembled from the CP shards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor
from typing_extensions import override

from lightning_cp.constants import CU_SEQLENS_PADDED
from lightning_cp.parallel.layout import current_layout
from lightning_cp.parallel.sharding import unshard


class TokenLogprobWriter(BasePredictionWriter):
    """Collects ``predict_step`` outputs ``{"logprobs": [B, S_local], "labels": [B, S_local]}`` and writes
    ``<output_dir>/logprobs.dp<r>.pt`` per data-parallel rank ``r``: a list with one dict per batch,
    ``{"batch_idx": int, "logprobs": [B, S], "labels": [B, S]}`` on the CPU.

    ``labels[b, t]`` is the id of the token after ``t`` (``-100`` where there is none: the last token of a
    sequence, padding) and ``logprobs[b, t]`` its log-probability (0 there). The sequences are those the
    strategy sharded: padded to a multiple of ``2 * cp`` (padded rows at their end; packed documents each
    at their own end, along ``cu_seqlens_padded``). ``lightning-cp predict`` adds one writing under the
    first logger's directory.

    Communication: an all-gather over the CP group per batch (none at ``cp = 1``); only CP rank 0 and TP
    rank 0 of each DP rank write.
    """

    def __init__(self, output_dir: str | Path) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)
        self._batches: list[dict[str, Any]] = []

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batches = []

    @override
    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        layout = current_layout()
        full = {
            name: reassemble(prediction[name], batch, layout.cp_group).cpu()
            for name in ("logprobs", "labels")
        }
        self._batches.append({"batch_idx": batch_idx, **full})

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        layout = current_layout()
        if layout.cp_rank == 0 and layout.tp_rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            torch.save(self._batches, self.path(layout.dp_rank))
        self._batches = []

    def path(self, dp_rank: int) -> Path:
        """The file of data-parallel rank ``dp_rank``."""
        return self.output_dir / f"logprobs.dp{dp_rank}.pt"


def reassemble(local: Tensor, batch: dict[str, Any], cp_group: dist.ProcessGroup | None) -> Tensor:
    """``[B, S_local, ...]`` of this CP rank -> ``[B, S, ...]`` of the sharded (padded) sequences, on every CP
    rank. Communication: one all-gather over ``cp_group`` (none when it is ``None``)."""
    if cp_group is None:
        return local
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(shards, local.contiguous(), group=cp_group)
    return unshard(shards, cu_seqlens=batch.get(CU_SEQLENS_PADDED))
