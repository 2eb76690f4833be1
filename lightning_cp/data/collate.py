"""Collate functions that turn per-sequence samples into the two batch forms of the batch contract.

A *sample* is a dict of 1-D tensors of one common length ``L``: ``input_ids`` (integer token ids,
required) and any other per-token keys (``loss_mask``, ``labels``, ``position_ids``, ...). Nothing is
shifted here: ``loss_mask[t] == 1`` means "token ``t`` is a target" and the strategy's ``shard_batch``
later turns that into next-token labels, pads every sequence to a multiple of ``2 * cp`` and splits it.

- :func:`collate_padded` stacks ``B`` samples into ``[B, S]`` rows, right-padded to the longest one.
- :func:`collate_packed` concatenates ``n`` samples into one ``[1, T]`` row with ``cu_seqlens``, so no
  compute is spent on padding and attention is masked per document.

A sample without ``loss_mask`` gets an all-ones mask (every real token is a target), so the collated
batch always carries one and padding is never a target.

Example::

    from torch.utils.data import DataLoader
    from lightning_cp.data import LongRangeCopyDataset, collate_packed

    loader = DataLoader(LongRangeCopyDataset(num_samples=64, seq_len=128, min_len=32), batch_size=4,
                        collate_fn=collate_packed)
    batch = next(iter(loader))   # input_ids [1, T], loss_mask [1, T], cu_seqlens [5] int32
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from lightning_cp.constants import CU_SEQLENS, IGNORE_INDEX, INPUT_IDS, INPUT_MASK, LABELS, LOSS_MASK


def collate_padded(samples: Sequence[Mapping[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad ``B`` variable-length samples into a ``[B, S]`` batch, ``S`` = the longest sample.

    Args:
        samples: ``B`` dicts of 1-D tensors of each sample's length ``L_i``; ``input_ids`` is required,
            every sample must have the same keys.
        pad_id: token id written into ``input_ids`` padding. It is never scored (``loss_mask`` is 0
            there), so any id inside the model's vocabulary works.

    Returns:
        ``input_ids`` ``[B, S]`` int64 and ``loss_mask`` ``[B, S]`` (the samples' dtype, float32 when
        they had none), ``input_mask`` ``[B, S]`` bool (False on padding: token counts skip it), plus
        every other key of the samples as ``[B, S]``. Padding values:
        ``input_ids`` -> ``pad_id``, ``labels`` -> :data:`IGNORE_INDEX`, everything else -> 0 (so
        ``loss_mask`` is 0 on padding). No communication; runs in the DataLoader worker.

    Raises:
        ValueError: if ``samples`` is empty, a sample lacks ``input_ids``, is empty, has a key that is
            not a 1-D tensor of the sample's length, or the samples' keys differ.
    """
    columns = _columns(samples)
    batch = {}
    for key, values in columns.items():
        padding_value = pad_id if key == INPUT_IDS else IGNORE_INDEX if key == LABELS else 0
        batch[key] = pad_sequence(values, batch_first=True, padding_value=padding_value)
    lengths = torch.tensor([len(ids) for ids in columns[INPUT_IDS]])
    batch[INPUT_MASK] = torch.arange(batch[INPUT_IDS].shape[1]) < lengths[:, None]
    return batch


def collate_packed(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate ``n`` variable-length samples into one packed ``[1, T]`` row with ``cu_seqlens``.

    Args:
        samples: ``n`` dicts of 1-D tensors of each sample's length ``L_i > 0``; ``input_ids`` is
            required, every sample must have the same keys.

    Returns:
        ``input_ids`` ``[1, T]`` int64 with ``T = sum(L_i)``, ``loss_mask`` ``[1, T]`` (the samples'
        dtype, float32 when they had none), every other key of the samples as ``[1, T]``, and
        ``cu_seqlens`` ``[n + 1]`` int32: ``0, L_0, L_0 + L_1, ..., T`` (int32 because that is what
        variable-length attention kernels take). No padding is added here: ``shard_batch`` pads each
        sequence to a multiple of ``2 * cp`` itself. No communication.

    Raises:
        ValueError: as :func:`collate_padded`.
    """
    columns = _columns(samples)
    batch = {key: torch.cat(values).unsqueeze(0) for key, values in columns.items()}
    lengths = torch.tensor([len(ids) for ids in columns[INPUT_IDS]], dtype=torch.int32)
    batch[CU_SEQLENS] = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return batch


def _columns(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """Validate the samples and regroup them key by key (``input_ids`` as int64, ``loss_mask`` added)."""
    if len(samples) == 0:
        raise ValueError("samples=[] is empty: a batch needs at least one sample.")
    keys = set(samples[0])
    if INPUT_IDS not in keys:
        raise ValueError(f"Each sample needs an {INPUT_IDS!r} tensor; got keys {sorted(keys)}.")
    columns: dict[str, list[torch.Tensor]] = {key: [] for key in samples[0]}
    columns.setdefault(LOSS_MASK, [])
    for i, sample in enumerate(samples):
        if set(sample) != keys:
            raise ValueError(
                f"samples[{i}] has keys {sorted(sample)} but samples[0] has {sorted(keys)}; every sample "
                "of a batch needs the same keys."
            )
        ids = sample[INPUT_IDS]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.numel() == 0:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"samples[{i}][{INPUT_IDS!r}] must be a non-empty 1-D tensor, got {shape}.")
        for key, value in sample.items():
            if not isinstance(value, torch.Tensor) or value.shape != ids.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(
                    f"samples[{i}][{key!r}] must be a 1-D tensor of the sample's length {ids.numel()} "
                    f"(aligned with input_ids), got {shape}."
                )
            columns[key].append(value.long() if key == INPUT_IDS else value)
        if LOSS_MASK not in keys:
            columns[LOSS_MASK].append(torch.ones(ids.numel(), dtype=torch.float32))
    return columns
