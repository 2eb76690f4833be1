"""Datasets, collate functions and DataModules that produce batches of the package's batch contract.

- :class:`LongRangeCopyDataset` / :class:`LongRangeDataModule`: a synthetic copy task that only a model
  whose attention crosses CP shards can learn (the default end-to-end check).
- :class:`TokenFileDataModule`: a user's pre-tokenized corpus, either a flat ``uint16`` / ``uint32`` token
  file (:class:`TokenFileDataset`; fixed windows or EOS-delimited documents; its dtype recorded in the
  sidecar that :func:`write_token_file` writes) or a Megatron-LM / NeMo indexed dataset
  (:class:`MegatronIndexedDataset`, ``prefix.bin`` + ``prefix.idx``; its documents).
- :class:`TextDataModule`: local text or chat files (``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow``)
  tokenized once with a local ``transformers`` tokenizer (``datasets`` caches them), packed into rows of
  ``seq_len`` tokens best-fit decreasing (:func:`pack_documents`); for chat only the assistant's tokens are
  targets.
- :class:`RolloutDataModule`: reinforcement-learning rollouts (prompt + sampled completion, as token ids or chat
  text, with a reward or an advantage and optional old / reference log-probs) as batches with completion-only
  targets and per-token ``advantages``, ``old_logprobs``, ``ref_logprobs`` and ``rollout_index``, GRPO's
  group-normalized advantages computed over the whole file first; the log-probs ``lightning-cp predict``
  writes for a rollout file are read back by ``old_logprobs`` / ``ref_logprobs``.
- :class:`ResumableDataLoader`: a ``DataLoader`` whose position in the epoch is checkpointed, for exact
  mid-epoch resumption.
- :func:`collate_padded` (``[B, S]``) and :func:`collate_packed` (``[1, T]`` + ``cu_seqlens``).

Samples and batches are un-shifted: ``loss_mask[t] == 1`` marks token ``t`` as a target, and the
strategy's ``shard_batch`` makes the next-token labels and the CP split (shifting ``advantages`` and the
log-probs with them: after it, the value at ``t`` is about the label at ``t``, token ``t + 1``). Nothing here imports
Megatron-core, so DataLoader workers stay light.
"""

from lightning_cp.data.collate import collate_packed, collate_padded
from lightning_cp.data.datamodule import LongRangeDataModule, TokenFileDataModule
from lightning_cp.data.megatron_indexed import MegatronIndexedDataset
from lightning_cp.data.packing import Piece, pack_documents
from lightning_cp.data.resumable import ResumableDataLoader
from lightning_cp.data.rollouts import RolloutDataModule
from lightning_cp.data.synthetic import LongRangeCopyDataset
from lightning_cp.data.text import PackedRows, PackingSummary, TextDataModule
from lightning_cp.data.token_file import TokenFileDataset, write_token_file

__all__ = [
    "LongRangeCopyDataset",
    "LongRangeDataModule",
    "MegatronIndexedDataset",
    "PackedRows",
    "PackingSummary",
    "Piece",
    "ResumableDataLoader",
    "RolloutDataModule",
    "TextDataModule",
    "TokenFileDataModule",
    "TokenFileDataset",
    "collate_packed",
    "collate_padded",
    "pack_documents",
    "write_token_file",
]
