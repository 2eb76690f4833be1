"""Write the per-token log-probabilities of a rollout file's completions, one list per rollout, as
:class:`~lightning_cp.data.RolloutDataModule` reads them back (``old_logprobs`` / ``ref_logprobs``), in the
format of :mod:`lightning_cp.rollout_logprob_format`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from lightning_cp.callbacks.logprob_writer import reassemble
from lightning_cp.constants import IGNORE_INDEX, INPUT_IDS, INPUT_MASK, ROLLOUT_INDEX
from lightning_cp.parallel.layout import current_layout
from lightning_cp.rollout_logprob_format import LogprobEntry, LogprobPartWriter, part_path


class RolloutLogprobWriter(BasePredictionWriter):
    """Takes ``predict_step`` outputs ``{"logprobs": [B, S_local], "labels": [B, S_local]}`` of batches that
    carry ``rollout_index`` (:class:`~lightning_cp.data.RolloutDataModule`'s) and writes
    ``<output_dir>/logprobs.dp<r>.jsonl`` per data-parallel rank ``r``, one line per rollout it predicted, as
    they are predicted (nothing is held beyond a batch)::

        {"rollout": i, "tokens": [...], "logprobs": [...]}

    ``rollout`` is the rollout's row in its file, ``tokens`` every token id of the rollout (prompt then
    completion: what :func:`~lightning_cp.data.rollout_logprobs.read_logprob_dir` checks the file against, so
    that a directory written for other rollouts, another tokenizer or chat template is refused), ``logprobs``
    the log-probability of each completion token given the tokens before it, in order (the model's
    ``predict_step``: ``logprobs[t]`` is the label's, token ``t + 1``'s, wherever ``labels[t] != -100``).
    ``lightning-cp predict`` adds one, writing under the first logger's directory, when the data module is a
    ``RolloutDataModule``; pass the directory as ``RolloutDataModule(ref_logprobs=...)`` or
    ``old_logprobs=...``. A part is named when predict ends; until then (and after a failed run) it is
    ``logprobs.dp<r>.jsonl.partial``, which a reader does not read.

    Communication: two all-gathers over the CP group per batch (none at ``cp = 1``), the full sequences
    reassembled as :class:`~lightning_cp.callbacks.TokenLogprobWriter` does; only CP rank 0 and TP rank 0 of
    each DP rank write.

    Raises:
        ValueError: a predicted batch without ``rollout_index`` (use :class:`TokenLogprobWriter` for other data).
    """

    def __init__(self, output_dir: str | Path) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = Path(output_dir)
        self._part: LogprobPartWriter | None = None

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        layout = current_layout()
        if layout.cp_rank == 0 and layout.tp_rank == 0:
            self._part = LogprobPartWriter(self.output_dir, layout.dp_rank)

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
        if ROLLOUT_INDEX not in batch:
            raise ValueError(
                f"RolloutLogprobWriter writes the log-probs of rollouts, but predict's batch {batch_idx} has no "
                f"{ROLLOUT_INDEX!r} (its keys: {sorted(batch)}); predict with a RolloutDataModule, or write with "
                "TokenLogprobWriter."
            )
        layout = current_layout()
        columns = (batch[INPUT_IDS], prediction["labels"], batch[ROLLOUT_INDEX], batch[INPUT_MASK].long())
        ints = reassemble(torch.stack(columns, dim=-1), batch, layout.cp_group).cpu()
        logprobs = reassemble(prediction["logprobs"], batch, layout.cp_group).cpu()
        if self._part is None:
            return
        tokens, labels, rollout, real = ints.unbind(-1)
        real = real.bool()
        for index in rollout[real].unique().tolist():
            mine = real & (rollout == index)
            targets = logprobs[mine & (labels != IGNORE_INDEX)]
            self._part.write(LogprobEntry(index, tokens[mine].tolist(), targets.float().tolist()))

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._part is not None:
            self._part.commit()
            self._part = None

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Close the part, left as ``.partial`` (which a reader does not read)."""
        if self._part is not None:
            self._part.abandon()
            self._part = None

    def path(self, dp_rank: int) -> Path:
        """The file of data-parallel rank ``dp_rank``."""
        return part_path(self.output_dir, dp_rank)
