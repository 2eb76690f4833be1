"""The sharded batch a rank is processing, for model code that cannot receive it as an argument.

A model's attention needs the batch's :class:`~lightning_cp.parallel.CPShard`, but a third-party
model (a Hugging Face ``transformers`` model, say) only hands its attention function the query, key and
value tensors. :class:`~lightning_cp.MegatronCPStrategy` therefore records every batch it shards here
(in ``batch_to_device``, right after :func:`~lightning_cp.parallel.shard_batch`), and such attention
functions read :func:`current_batch`. Code that shards batches itself calls :func:`set_current_batch`.

The record is per process and replaced by the next batch; the strategy clears it in ``teardown``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_cp.constants import CP_SHARD, POSITION_IDS
from lightning_cp.parallel.sharding import CPShard


@dataclass(eq=False)
class CurrentBatch:
    """What attention reads of the batch being processed (one per batch, shared by every layer)."""

    cp_shard: CPShard
    """The batch's layout: sequences, this rank's pieces of them, the keys of every piece."""
    position_ids: Tensor
    """``[B, S_local]`` int64: the positions the model must be given (``batch["position_ids"]``)."""
    positions_checked: bool = False
    """Set once a layer has verified that the model was given :attr:`position_ids` (once per batch)."""


_current: CurrentBatch | None = None


def set_current_batch(batch: Mapping[str, Any] | None) -> None:
    """Record ``batch``, a batch sharded by :func:`~lightning_cp.parallel.shard_batch` (``None``: forget it).

    Raises:
        ValueError: ``batch`` is not a sharded batch (no ``cp_shard`` or ``position_ids``).
    """
    global _current
    if batch is None:
        _current = None
        return
    missing = [key for key in (CP_SHARD, POSITION_IDS) if key not in batch]
    if missing:
        raise ValueError(
            f"set_current_batch needs a batch sharded by shard_batch; it has no {missing}. "
            "Call shard_batch(batch, cp, rank) first."
        )
    _current = CurrentBatch(batch[CP_SHARD], batch[POSITION_IDS])


def current_batch() -> CurrentBatch | None:
    """The batch recorded by :func:`set_current_batch`, or ``None`` outside a sharded step."""
    return _current
