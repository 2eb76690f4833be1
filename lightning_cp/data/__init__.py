"""Datasets, collate functions and DataModules that produce batches of the package's batch contract.

- :class:`LongRangeCopyDataset` / :class:`LongRangeDataModule`: a synthetic copy task that only a model
  whose attention crosses CP shards can learn (the default end-to-end check).
- :class:`TokenFileDataset` / :class:`TokenFileDataModule`: a user's flat ``uint16`` / ``uint32`` token
  file, as fixed windows or EOS-delimited documents.
- :func:`collate_padded` (``[B, S]``) and :func:`collate_packed` (``[1, T]`` + ``cu_seqlens``).

Samples and batches are un-shifted: ``loss_mask[t] == 1`` marks token ``t`` as a target, and the
strategy's ``shard_batch`` makes the next-token labels and the CP split.
"""

from lightning_cp.data.collate import collate_packed, collate_padded
from lightning_cp.data.datamodule import LongRangeDataModule, TokenFileDataModule
from lightning_cp.data.synthetic import LongRangeCopyDataset
from lightning_cp.data.token_file import TokenFileDataset

__all__ = [
    "LongRangeCopyDataset",
    "LongRangeDataModule",
    "TokenFileDataModule",
    "TokenFileDataset",
    "collate_packed",
    "collate_padded",
]
