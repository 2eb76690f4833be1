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

from collections.abc import MutableMapping
from typing import Any


def resume_inside_the_epoch(checkpoint: MutableMapping[str, Any]) -> None:
    """Mark the epoch of ``checkpoint`` as started but not processed when it stopped before its last batch.

    A checkpoint whose training epoch reached its last batch, or that has no fit loop state (saved by
    ``trainer.save_checkpoint`` outside ``fit``, or by another version of Lightning), is left unchanged.
    """
    loop = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(loop, MutableMapping):
        return
    batches = loop.get("epoch_loop.batch_progress", {})
    epochs = loop.get("epoch_progress", {})
    if batches.get("is_last_batch", True) or not batches.get("current", {}).get("completed"):
        return  # the epoch ran to its end, or no batch of it was trained: nothing is lost
    for count in (epochs.get("total"), epochs.get("current")):
        if not count or count["processed"] != count["started"]:
            continue  # saved while the epoch was running: already resumes inside it
        count["processed"] = count["completed"] = count["started"] - 1
