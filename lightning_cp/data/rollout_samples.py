"""A rollout file's rows as samples of the batch contract, and every rollout once per epoch over the
data-parallel ranks.

:class:`RolloutSamples` makes the samples (their layout: :mod:`lightning_cp.data.rollouts`). Lightning's own
``DistributedSampler`` gives each of ``dp`` ranks ``ceil(N / dp)`` items and, when ``N`` does not divide,
makes up the difference by repeating the epoch's first items: those rollouts would train twice per epoch (and
a validation rollout count twice). Every rank must still run the same number of steps (each step is a
collective), so :class:`UnrepeatedDistributedSampler` keeps that sampler's order and length and yields
:data:`PADDING` where it would repeat; the data set answers it with a sample without any target
(:meth:`RolloutSamples.padding_sample`), and :func:`collate_rollouts` drops such samples from a batch that
has rollouts. A rank left with padding alone gets one token that is neither a target nor an input
(``input_mask`` False). The loss normalizers count targets, and sequences that have one, over the global
batch, so step ``k`` trains exactly the ``k``-th chunk of ``batch_size * dp`` items of the epoch's order
(the last chunk short), as the unsharded global batch would, and no rollout is dropped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Trainer
from torch.utils.data import Dataset, DistributedSampler

from lightning_cp.constants import ADVANTAGES, INPUT_IDS, INPUT_MASK, LOSS_MASK, ROLLOUT_INDEX
from lightning_cp.data.collate import collate_packed, collate_padded
from lightning_cp.data.rollout_records import LOGPROB_KEYS, PROMPT_LENGTH

PADDING = -1
"""The index :class:`UnrepeatedDistributedSampler` yields instead of a repeated one, and the
``rollout_index`` of the sample that stands for it."""


class RolloutSamples(Dataset):
    """A split's rollouts as samples of the batch contract (:mod:`lightning_cp.data.rollouts` has the layout).

    An item is one rollout's sample (``rows=None``: padded batches) or the samples of one packed row (a list);
    index :data:`PADDING` is :meth:`padding_sample` (in a list when packed).

    Args:
        rollouts: the tokenized rollouts (a ``datasets.Dataset``: ``input_ids``, ``prompt_length`` and any
            ``old_logprobs`` / ``ref_logprobs`` columns).
        advantages: ``[N]`` every rollout's advantage.
        logprobs: log-probabilities read from a directory, by batch key: one array per rollout.
        rows: the rollouts of every packed row, or ``None``.
        pad_id: the token of :meth:`padding_sample`.
    """

    def __init__(
        self,
        rollouts: Any,
        advantages: np.ndarray,
        logprobs: dict[str, list[np.ndarray]],
        rows: list[list[int]] | None,
        pad_id: int = 0,
    ) -> None:
        self.rollouts, self.advantages, self.logprobs, self.rows = rollouts, advantages, logprobs, rows
        self.pad_id = pad_id
        self._columns = [key for key in LOGPROB_KEYS if key in rollouts.column_names]

    def __len__(self) -> int:
        return len(self.rollouts) if self.rows is None else len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]:
        if index == PADDING:
            return self.padding_sample() if self.rows is None else [self.padding_sample()]
        if self.rows is None:
            return self.sample(index)
        return [self.sample(rollout) for rollout in self.rows[index]]

    def padding_sample(self) -> dict[str, torch.Tensor]:
        """A sample of the keys of :meth:`sample` that stands for no rollout: one ``pad_id`` token, no target,
        every value 0 and ``rollout_index`` :data:`PADDING`."""
        zeros = torch.zeros(1, dtype=torch.float32)
        values = {key: zeros for key in [*self._columns, *self.logprobs]}
        return {
            INPUT_IDS: torch.full((1,), self.pad_id, dtype=torch.int64),
            LOSS_MASK: zeros,
            ADVANTAGES: zeros,
            ROLLOUT_INDEX: torch.full((1,), PADDING, dtype=torch.int64),
            **values,
        }

    def sample(self, rollout: int) -> dict[str, torch.Tensor]:
        """Rollout ``rollout``'s sample: ``[L]`` tensors, ``L`` = prompt + completion tokens."""
        row = self.rollouts[rollout]
        ids = torch.tensor(row[INPUT_IDS], dtype=torch.int64)
        prompt = row[PROMPT_LENGTH]
        completion = torch.zeros(len(ids), dtype=torch.float32)
        completion[prompt:] = 1.0
        sample = {
            INPUT_IDS: ids,
            LOSS_MASK: completion,
            ADVANTAGES: completion * float(self.advantages[rollout]),
            ROLLOUT_INDEX: torch.full_like(ids, rollout),
        }
        values = {key: row[key] for key in self._columns} | {k: v[rollout] for k, v in self.logprobs.items()}
        for key, completion_values in values.items():
            sample[key] = torch.zeros(len(ids), dtype=torch.float32)
            sample[key][prompt:] = torch.as_tensor(np.asarray(completion_values, dtype=np.float32))
        return sample


class UnrepeatedDistributedSampler(DistributedSampler):
    """``DistributedSampler``'s order (same seed, same permutation, rank ``r`` takes positions ``r, r + dp,
    ...``) and length (``ceil(N / dp)`` per rank), with :data:`PADDING` where it would repeat an index.

    Lightning keeps a loader's sampler of this type (it replaces only samplers that are no
    ``DistributedSampler``) and sets its epoch.
    """

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        else:
            order = list(range(len(self.dataset)))  # type: ignore[arg-type]
        mine = order[self.rank :: self.num_replicas]
        return iter(mine + [PADDING] * (self.num_samples - len(mine)))


def data_parallel_sampler(
    trainer: Trainer | None, dataset: Dataset, shuffle: bool
) -> UnrepeatedDistributedSampler | None:
    """The sampler of a training (``shuffle``) or evaluation loader under the trainer's distributed strategy,
    over its data-parallel ranks (``strategy.distributed_sampler_kwargs``: CP peers share a rank) and seeded as
    Lightning seeds its own (``PL_GLOBAL_SEED``); ``None`` without a trainer or a distributed strategy."""
    kwargs = None if trainer is None else trainer.distributed_sampler_kwargs
    if kwargs is None:
        return None
    seed = int(os.getenv("PL_GLOBAL_SEED", "0"))
    return UnrepeatedDistributedSampler(dataset, shuffle=shuffle, seed=seed, **kwargs)


def collate_rollouts(items: Sequence[Any], packed: bool, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A batch of rollout samples (``packed``: of rows, lists of samples), the padding samples dropped.

    A batch of padding alone keeps one padding sample, with ``input_mask`` False on its tokens (token counts
    and routers' statistics skip it). Otherwise :func:`~lightning_cp.data.collate_packed` /
    :func:`~lightning_cp.data.collate_padded` (``pad_id``) of the rollouts.
    """
    samples: list[Mapping[str, torch.Tensor]] = (
        [sample for row in items for sample in row] if packed else list(items)
    )
    rollouts = [sample for sample in samples if int(sample[ROLLOUT_INDEX][0]) != PADDING]
    kept = rollouts or samples[:1]
    batch = collate_packed(kept) if packed else collate_padded(kept, pad_id=pad_id)
    if not rollouts:
        batch[INPUT_MASK] = torch.zeros_like(batch[INPUT_IDS], dtype=torch.bool)
    return batch
