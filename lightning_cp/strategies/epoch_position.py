"""A run stopped before its epoch ended resumes inside that epoch, whichever hook saved its checkpoint.

Lightning counts an epoch as processed when its loop ends, whatever ended it. A run stopped by
``max_steps`` (or ``trainer.should_stop``) at batch 3 of 8 saves ``last.ckpt`` from ``on_train_epoch_end``
or ``on_train_end`` with the epoch already counted: the same command with a higher ``max_steps`` then starts
the next epoch (its sampler seeded with the next epoch number) and the rest of the first is never seen. A
checkpoint saved mid-epoch by ``on_train_batch_end`` (``every_n_train_steps``) does not have this problem.

:func:`resume_inside_the_epoch` rewrites the loop state of such a checkpoint, at load, to the state of a
checkpoint saved after the same batch: the epoch started, not processed. The loader's position
(:class:`~lightning_cp.data.ResumableDataLoader`) is already the number of batches taken, so the resumed run
continues with the epoch's next batch, as the uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any


def resume_inside_the_epoch(checkpoint: MutableMapping[str, Any]) -> None:
    """Mark the epoch of ``checkpoint`` as started but not processed when it stopped before its last batch.

    A checkpoint whose training epoch reached its last batch, or that has no fit loop state (saved by
    ``trainer.save_checkpoint`` outside ``fit``, or by another version of Lightning), is left unchanged.
    """
    loop = _fit_loop(checkpoint)
    if loop is None or not _stopped_inside_its_epoch(loop):
        return
    epochs = loop.get("epoch_progress", {})
    for count in (epochs.get("total"), epochs.get("current")):
        if count and count["processed"] == count["started"]:  # else saved while the epoch ran: resumes inside
            count["processed"] = count["completed"] = count["started"] - 1


def finished_epochs(checkpoint: Mapping[str, Any]) -> int:
    """The training epochs of ``checkpoint`` that ran to their last batch (0 without fit loop state): what
    ``Trainer(max_epochs=...)`` is compared with when it resumes from it."""
    loop = _fit_loop(checkpoint)
    if loop is None:
        return 0
    processed = int(loop.get("epoch_progress", {}).get("current", {}).get("processed", 0))
    started = int(loop.get("epoch_progress", {}).get("current", {}).get("started", 0))
    if _stopped_inside_its_epoch(loop) and processed == started:
        return processed - 1
    return processed


def _fit_loop(checkpoint: Mapping[str, Any]) -> Mapping[str, Any] | None:
    loop = checkpoint.get("loops", {}).get("fit_loop")
    return loop if isinstance(loop, Mapping) else None


def _stopped_inside_its_epoch(loop: Mapping[str, Any]) -> bool:
    """Whether the fit loop's last epoch trained some batches but not its last one."""
    batches = loop.get("epoch_loop.batch_progress", {})
    return not batches.get("is_last_batch", True) and bool(batches.get("current", {}).get("completed"))
