"""The global batch a run trains with, kept in its checkpoints and compared when a run resumes from one.

``data.batch_size`` counts samples per data-parallel rank, so an optimizer step sees
``dp * batch_size * accumulate_grad_batches`` samples: resuming a dp=2 x cp=2 run on dp=1 x cp=4 halves
them, and the tokens per step, unless the accumulation doubles. :class:`GlobalBatchRecord` (which the
package's strategies add to the callbacks) saves the layout and the global batch in every checkpoint and,
when a resumed run trains with another, says once how the global batch changes and how to keep it.

Lightning closes an accumulation window when the batches of the epoch so far are a multiple of
``accumulate_grad_batches``, so a run resumed mid-epoch with another accumulation (3 batches done, now 2 per
step) takes its first optimizer step after fewer micro-batches; the record says that too, after that step.
The loss of such a step is still the mean over its own tokens (:mod:`lightning_cp.loss.objective`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override


@dataclasses.dataclass(frozen=True)
class GlobalBatch:
    """The (dp, cp, tp) layout and what one optimizer step trains on."""

    dp: int
    cp: int
    tp: int
    batch_size: int | None
    """Samples per batch on each data-parallel rank; ``None`` when the loader does not say."""
    accumulate_grad_batches: int
    seq_len: int | None
    """The data module's ``seq_len`` (the longest sample), if it has one."""

    @classmethod
    def of(cls, trainer: Trainer) -> GlobalBatch:
        """The global batch ``trainer`` trains with (once its strategy and train loader are set up)."""
        layout = trainer.strategy.layout
        batch_size = getattr(trainer.train_dataloader, "batch_size", None)
        seq_len = getattr(trainer.datamodule, "seq_len", None)
        return cls(
            dp=layout.dp,
            cp=layout.cp,
            tp=layout.tp,
            batch_size=batch_size if isinstance(batch_size, int) else None,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            seq_len=seq_len if isinstance(seq_len, int) else None,
        )

    @property
    def samples(self) -> int | None:
        """Samples per optimizer step, ``dp * batch_size * accumulate_grad_batches``."""
        return None if self.batch_size is None else self.dp * self.batch_size * self.accumulate_grad_batches

    def describe(self) -> str:
        """``"dp=2 x cp=2 x tp=1, 2 x 8 x 1 = 16 samples (at most 2048 tokens at seq_len 128)"``."""
        if self.samples is None:
            return f"{self.layout}, accumulate_grad_batches={self.accumulate_grad_batches}"
        text = f"{self.layout}, {self.dp} x {self.batch_size} x {self.accumulate_grad_batches} = {self.samples} samples"
        if self.seq_len is not None:
            text += f" (at most {self.samples * self.seq_len} tokens at seq_len {self.seq_len})"
        return text

    @property
    def layout(self) -> str:
        return f"dp={self.dp} x cp={self.cp} x tp={self.tp}"


def global_batch_change(before: GlobalBatch, now: GlobalBatch) -> tuple[str, bool] | None:
    """What to say when a run of ``before`` resumes as ``now``: ``(message, whether to warn)``.

    ``None`` when nothing changed. A warning when the samples per optimizer step change (with the
    ``accumulate_grad_batches``, else the ``batch_size``, that keeps them when there is one) or may change
    (a loader without ``batch_size``, another dp or accumulation); otherwise an info line.
    """
    if before == now:
        return None
    head = f"resumed a run of {before.describe()} as {now.describe()}"
    if before.samples is None or now.samples is None:
        if (before.dp, before.accumulate_grad_batches) == (now.dp, now.accumulate_grad_batches):
            return f"{head}.", False
        return (
            f"{head}: the samples per optimizer step (dp x batch size x accumulate_grad_batches) may change.",
            True,
        )
    if before.samples == now.samples:
        return f"{head}: the same {now.samples} samples per optimizer step.", False
    message = (
        f"{head}: the global batch changes from {before.samples} to {now.samples} samples per optimizer step "
        "(dp x batch_size x accumulate_grad_batches)."
    )
    per_micro_batch = now.dp * now.batch_size
    if before.samples % per_micro_batch == 0:
        message += f" To keep it, set trainer.accumulate_grad_batches={before.samples // per_micro_batch}."
    elif before.samples % (now.dp * now.accumulate_grad_batches) == 0:
        message += (
            f" To keep it, set data.batch_size={before.samples // (now.dp * now.accumulate_grad_batches)}."
        )
    return message, True


class GlobalBatchRecord(Callback):
    """Saves :class:`GlobalBatch` in checkpoints; on resume, says once (rank 0) how it changed.

    A warning when the samples per optimizer step change (with the ``accumulate_grad_batches`` or
    ``batch_size`` that keeps them, when one does), an info line when only the layout changed. With another
    ``accumulate_grad_batches``, a second warning after the first optimizer step if that step accumulated
    fewer micro-batches (a resume in the middle of an epoch: see the module docstring).
    """

    def __init__(self) -> None:
        self._now: GlobalBatch | None = None
        self._before: GlobalBatch | None = None
        self._first_window: int | None = None
        """Micro-batches since a resume with another accumulation, until its first optimizer step."""

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._now = GlobalBatch.of(trainer)
        change = None if self._before is None else global_batch_change(self._before, self._now)
        if change is not None:
            message, warn = change
            (rank_zero_warn if warn else rank_zero_info)(message)
        accumulation_changed = (
            self._before is not None
            and self._before.accumulate_grad_batches != self._now.accumulate_grad_batches
        )
        self._first_window = 0 if accumulation_changed else None

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._first_window is not None:
            self._first_window += 1

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._first_window is None:
            return
        taken, self._first_window = self._first_window, None
        assert self._before is not None and self._now is not None
        accumulate = self._now.accumulate_grad_batches
        if taken < accumulate:
            rank_zero_warn(
                f"the first optimizer step after resuming (step {trainer.global_step + 1}) accumulated {taken} "
                f"micro-batch(es), not accumulate_grad_batches={accumulate}: the run resumed in the middle of an "
                f"epoch with accumulate_grad_batches changed from {self._before.accumulate_grad_batches}, and "
                "Lightning counts the accumulation from the epoch's first batch. Its loss is the mean over its "
                f"own tokens; the next steps accumulate {accumulate}. Resume with the same "
                "accumulate_grad_batches, or from a checkpoint at the end of an epoch, to keep every step's batch."
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {} if self._now is None else dataclasses.asdict(self._now)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._before = GlobalBatch(**state_dict) if state_dict else None
