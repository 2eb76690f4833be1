"""A ``DataLoader`` that remembers how far into the epoch it is, so a resumed run continues mid-epoch.

Lightning saves the ``state_dict()`` of every training loader that has one in its checkpoints and hands
it back to ``load_state_dict()`` when a fit resumes mid-epoch; a plain ``DataLoader`` has none, so a run
resumed at step 50 would replay the epoch from its first batch. The position is the number of batches
this loader has handed out in the current epoch; Lightning does not prefetch from loaders that have a
length, so at a checkpoint it equals the number of batches trained on. The epoch's order itself comes from
the (distributed) sampler, which Lightning re-seeds with the epoch number, so skipping that many batches
of indices (without loading their samples) restores the exact data order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader
from typing_extensions import override


class ResumableDataLoader(DataLoader):
    """``DataLoader`` with Lightning's loader-state protocol (``state_dict`` / ``load_state_dict``).

    Takes ``DataLoader``'s arguments, so Lightning can re-create it with a ``DistributedSampler``. A
    loaded position is used by the next ``iter()`` only: its first ``batches`` index batches are skipped.
    Needs a map-style dataset (an iterable one has no index sampler to skip in).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._position = 0
        self._resume_at = 0

    def state_dict(self) -> dict[str, int]:
        """``{"batches": n}``: the batches of the current epoch handed out so far."""
        return {"batches": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Make the next epoch's iteration start after ``state["batches"]`` batches."""
        batches = int(state["batches"])
        if not 0 <= batches <= len(self):
            raise ValueError(
                f"The checkpoint's loader position ({batches} batches) does not fit this loader's epoch of "
                f"{len(self)} batches: resume with the data, batch size and DP size the checkpoint was made with."
            )
        self._resume_at = batches

    @property
    @override
    def _index_sampler(self) -> Iterable[Any]:
        sampler = super()._index_sampler
        return _Skipped(sampler, self._resume_at) if self._resume_at else sampler

    @override
    def __iter__(self) -> Iterator[Any]:
        iterator = super().__iter__()  # reads _index_sampler: the skip applies to this iteration only
        self._position, self._resume_at = self._resume_at, 0
        return self._counted(iterator)

    def _counted(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            self._position += 1
            yield batch


class _Skipped:
    """An index sampler without its first ``count`` items; its length stays the full epoch's, as
    Lightning counts the resumed epoch's batches from the checkpoint's progress."""

    def __init__(self, sampler: Iterable[Any], count: int) -> None:
        self._sampler = sampler
        self._count = count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self._sampler), self._count, None)

    def __len__(self) -> int:
        return len(self._sampler)  # type: ignore[arg-type]
