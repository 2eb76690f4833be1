"""A synthetic long-range copy task: learnable only when attention reaches across CP shards.

Each sample is ``L`` tokens: ``L / 2`` tokens drawn uniformly from ``[0, vocab_size)``, then an exact
copy of them. Only the second half is scored. Token ``L/2 + i`` equals token ``i``, so predicting it
needs the key ``L/2`` positions back; the first half is random, so nothing local helps. Under context
parallelism the two halves live on different CP ranks (the load-balanced split gives rank ``r``
chunks ``r`` and ``2*cp-1-r``), so the loss falls below ``log(vocab_size)`` only if K/V really flow
between ranks: a broken all-gather shows up as a loss stuck at chance level.

Example::

    from lightning_cp.data import LongRangeCopyDataset

    ds = LongRangeCopyDataset(num_samples=1000, seq_len=256, vocab_size=32768, seed=0)
    sample = ds[3]   # {"input_ids": int64 [256], "loss_mask": float32 [256]}, the same on every call
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from lightning_cp.constants import INPUT_IDS, LOSS_MASK


class LongRangeCopyDataset(Dataset):
    """``num_samples`` copy-task sequences, generated on the fly and deterministic per index.

    Sample ``i`` comes from a ``torch.Generator`` seeded with ``seed + i``, so any process, worker or
    instance produces the same sample for the same index without storing anything (every DP / CP rank
    and every DataLoader worker agrees, whatever the sampler order).

    Args:
        num_samples: number of samples (the dataset's ``len``).
        seq_len: length of every sample, or the longest one when ``min_len`` is set; even, >= 2.
        vocab_size: tokens are drawn from ``[0, vocab_size)``. A large vocabulary (the default 32768)
            makes guessing hopeless (chance loss ``log(vocab_size)``) and exercises the chunked loss.
        seed: base seed; sample ``i`` uses ``seed + i``. Give validation data a seed offset by at least
            the training ``num_samples`` to keep it disjoint from training.
        min_len: if set, sample ``i`` has a length drawn from the even numbers in ``[min_len, seq_len]``
            (deterministically, from the same generator), so packed batches hold sequences of unequal
            length. Even, ``2 <= min_len <= seq_len``. ``None``: every sample has length ``seq_len``.

    Each item is ``{"input_ids": int64 [L], "loss_mask": float32 [L]}`` with ``loss_mask`` 0 on the
    first half and 1 on the second.

    Raises:
        ValueError: on a non-positive ``num_samples``, ``vocab_size < 2``, an odd or too small
            ``seq_len`` / ``min_len``, or ``min_len > seq_len``.
    """

    def __init__(
        self,
        num_samples: int,
        seq_len: int,
        vocab_size: int = 32768,
        seed: int = 0,
        min_len: int | None = None,
    ) -> None:
        _check_copy_task(num_samples=num_samples, seq_len=seq_len, vocab_size=vocab_size, min_len=min_len)
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.seed = seed
        self.min_len = min_len

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index={index} is out of range for a dataset of {self.num_samples} samples.")
        generator = torch.Generator().manual_seed(self.seed + index)
        half = self.seq_len // 2
        if self.min_len is not None:
            half = int(torch.randint(self.min_len // 2, half + 1, (), generator=generator))
        first = torch.randint(0, self.vocab_size, (half,), generator=generator, dtype=torch.int64)
        loss_mask = torch.zeros(2 * half, dtype=torch.float32)
        loss_mask[half:] = 1.0
        return {INPUT_IDS: torch.cat([first, first]), LOSS_MASK: loss_mask}


def _check_copy_task(seq_len: int, vocab_size: int, min_len: int | None, **num_samples: int) -> None:
    """Validate the copy task's arguments; ``num_samples`` are keyword counts, each named in its error."""
    for name, count in num_samples.items():
        if count < 1:
            raise ValueError(f"{name}={count} must be at least 1.")
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size} must be at least 2 for the copy task to be learnable.")
    _check_even("seq_len", seq_len)
    if min_len is not None:
        _check_even("min_len", min_len)
        if min_len > seq_len:
            raise ValueError(f"min_len={min_len} is larger than seq_len={seq_len}; use min_len <= seq_len.")


def _check_even(name: str, value: int) -> None:
    if value < 2 or value % 2:
        raise ValueError(
            f"{name}={value} must be an even number >= 2: the second half of each sample copies the first."
        )
