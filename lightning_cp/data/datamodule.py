"""LightningDataModules for the copy task and for token files, in padded or packed form.

Both build :class:`~lightning_cp.data.ResumableDataLoader` objects (a ``DataLoader`` whose position in
the epoch is saved in checkpoints, so a run resumed mid-epoch continues with the next batch) with
``shuffle=True`` for training and no sampler of their own: Lightning replaces the sampler with a ``DistributedSampler`` over the
*data-parallel* ranks the strategy reports (every rank of a CP group must see the same samples), which
it can only do for a DataLoader it can re-create from its arguments. ``batch_size`` is therefore per
data-parallel rank: the global batch is ``batch_size * dp`` samples, whatever ``cp`` is.

``packed=False`` yields ``{"input_ids": [B, S], "loss_mask": [B, S]}`` (right-padded to the longest
sample); ``packed=True`` yields ``{"input_ids": [1, T], "loss_mask": [1, T], "cu_seqlens": [B + 1]}``
with the ``batch_size`` samples concatenated. Both are un-shifted; the strategy's ``shard_batch`` does
the next-token shift and the CP split.

Both expose ``vocab_size`` so a model config can match it, e.g. in a LightningCLI subclass::

    parser.link_arguments("data.vocab_size", "model.vocab_size")

Example (YAML for ``lightning-cp fit``)::

    data:
      class_path: lightning_cp.data.LongRangeDataModule
      init_args: {seq_len: 4096, batch_size: 2, packed: true, min_len: 1024}
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from lightning_cp.data._token_spans import _check_sampled_ids, _check_seq_len
from lightning_cp.data.collate import collate_packed, collate_padded
from lightning_cp.data.megatron_indexed import MegatronIndexedDataset, _is_megatron_prefix, _MegatronIndex
from lightning_cp.data.resumable import ResumableDataLoader
from lightning_cp.data.synthetic import LongRangeCopyDataset, _check_copy_task
from lightning_cp.data.token_file import TokenDType, TokenFileDataset, _check_token_file


class _CPDataModule(LightningDataModule):
    """DataLoader construction shared by the DataModules (subclasses set ``_train``, ``_val`` in setup).

    ``collate`` replaces the padded / packed collate function of ``packed`` (a module-level function, so
    that workers started with ``spawn`` can pickle it).
    """

    def __init__(
        self,
        batch_size: int,
        packed: bool,
        shuffle: bool,
        num_workers: int,
        pad_id: int = 0,
        collate: Callable[[list[Any]], dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1 (it counts samples per DP rank).")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0 (0 loads in the main process).")
        self.batch_size = batch_size
        self.packed = packed
        self.shuffle = shuffle
        self.num_workers = num_workers
        if collate is None:
            collate = collate_packed if packed else functools.partial(collate_padded, pad_id=pad_id)
        self._collate = collate
        self._train: Dataset | None = None
        self._val: Dataset | None = None

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._train, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._val, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The held-out (validation) split: these data sets have no separate test split."""
        return self._loader(self._val, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        """The held-out (validation) split, for ``GPTModule.predict_step``'s per-token log-probabilities."""
        return self._loader(self._val, shuffle=False)

    def _loader(
        self, dataset: Dataset | None, shuffle: bool, sampler: Sampler[int] | None = None
    ) -> ResumableDataLoader:
        """A loader of ``dataset``, ``shuffle``d, or in the order of a ``sampler`` of the subclass's own
        (``shuffle=False`` then; Lightning keeps a sampler that is a ``DistributedSampler``)."""
        if dataset is None:
            raise RuntimeError(
                f"{type(self).__name__} has no datasets yet; call setup('fit') (the Trainer does) before "
                "asking for a dataloader."
            )
        return ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            sampler=sampler,
            collate_fn=self._collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


class LongRangeDataModule(_CPDataModule):
    """The synthetic long-range copy task (:class:`~lightning_cp.data.LongRangeCopyDataset`).

    The loss can fall below chance (``log(vocab_size)``) only if attention crosses CP shards, which
    makes this the default end-to-end check of a context-parallel setup. Training sample ``i`` uses seed
    ``seed + i`` and validation sample ``j`` seed ``seed + num_train_samples + j``, so the two never
    overlap.

    Args:
        vocab_size: tokens are uniform in ``[0, vocab_size)``; the model's vocabulary must be at least this.
        seq_len: sample length (the longest one when ``min_len`` is set); even.
        min_len: if set, each sample's length is drawn from the even numbers in ``[min_len, seq_len]``,
            so packed batches hold unequal sequences; ``None`` makes every sample ``seq_len`` long.
        num_train_samples: size of the training set (one epoch).
        num_val_samples: size of the validation set.
        batch_size: samples per batch on each data-parallel rank (CP peers share the same batch).
        packed: concatenate each batch into one ``[1, T]`` row with ``cu_seqlens`` instead of padding.
        shuffle: shuffle the training set in a single process. Under a distributed strategy Lightning's
            ``DistributedSampler`` always shuffles the training set (seeded, the same permutation for every
            DP x CP layout), whatever this says.
        seed: base seed of the samples.
        num_workers: DataLoader worker processes per rank (0: load in the training process).
    """

    def __init__(
        self,
        vocab_size: int = 32768,
        seq_len: int = 256,
        min_len: int | None = None,
        num_train_samples: int = 10_000,
        num_val_samples: int = 256,
        batch_size: int = 8,
        packed: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, packed=packed, shuffle=shuffle, num_workers=num_workers)
        _check_copy_task(
            seq_len=seq_len,
            vocab_size=vocab_size,
            min_len=min_len,
            num_train_samples=num_train_samples,
            num_val_samples=num_val_samples,
        )
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.min_len = min_len
        self.num_train_samples = num_train_samples
        self.num_val_samples = num_val_samples
        self.seed = seed

    def setup(self, stage: str) -> None:
        """Create the (lazy, on-the-fly) train and validation datasets; cheap, the same on every rank."""
        if self._train is not None:
            return
        common = {"seq_len": self.seq_len, "vocab_size": self.vocab_size, "min_len": self.min_len}
        self._train = LongRangeCopyDataset(self.num_train_samples, seed=self.seed, **common)
        val_seed = self.seed + self.num_train_samples
        self._val = LongRangeCopyDataset(self.num_val_samples, seed=val_seed, **common)


class TokenFileDataModule(_CPDataModule):
    """Training on a user's pre-tokenized corpus: a flat token file or a Megatron indexed dataset.

    ``path`` names one of two formats, told apart by the files present:

    - a **Megatron-LM / NeMo indexed dataset**, by its prefix (``path.idx`` exists):
      ``data/train_text_document`` for ``data/train_text_document.bin`` + ``.idx``, as given to Megatron's
      ``--data-path``. Documents and dtype come from the index
      (:class:`~lightning_cp.data.MegatronIndexedDataset`); leave ``dtype`` and ``eos_id`` unset. Pointing
      at the ``.bin`` or ``.idx`` itself is an error that names the prefix.
    - a **flat token file** (:class:`~lightning_cp.data.TokenFileDataset`): raw ``uint16`` / ``uint32`` ids.
      Its dtype comes from the sidecar ``path.json`` that :func:`~lightning_cp.data.write_token_file` (and
      ``examples/make_token_file.py``) write next to it, or, for a file without one, from ``dtype``, which is
      then required. Samples are fixed windows, or EOS-delimited documents with ``eos_id``.

    The last ``val_fraction`` of the samples (at least one) is the validation set and the rest the
    training set: a contiguous tail, so validation text does not sit next to training windows of the
    same documents.

    The constructor checks everything that does not need a full read of the data (files, sidecar, index,
    dtype, ``seq_len``, a sample of the ids), so that ``lightning-cp`` reports these mistakes as one
    line; ``setup`` then scans the ids once (``vocab_size``, EOS positions) and splits the samples.

    Args:
        path: a flat token file or the prefix of a Megatron indexed dataset (see above).
        vocab_size: the tokenizer's vocabulary size. Every id is checked against it once at ``setup`` (one
            sequential read of the file); the model's vocabulary must be at least this.
        seq_len: window length, or the longest piece a document is cut into.
        dtype: flat files without a sidecar: the integer type the file was written with (``uint16`` for
            vocabularies up to 65536). Otherwise leave it unset: the sidecar or the index records it, and a
            different value is an error.
        eos_id: flat files: end-of-document token id. Set it to train on whole documents (split after each
            EOS, long ones cut at ``seq_len``), usually with ``packed=True``; ``None`` cuts fixed windows.
            Megatron datasets: leave it unset (documents come from the index).
        val_fraction: share of the samples held out for validation, in ``(0, 1)``.
        batch_size: samples per batch on each data-parallel rank (CP peers share the same batch).
        packed: concatenate each batch into one ``[1, T]`` row with ``cu_seqlens`` instead of padding.
        shuffle: shuffle the training set in a single process. Under a distributed strategy Lightning's
            ``DistributedSampler`` always shuffles the training set (seeded, the same permutation for every
            DP x CP layout), whatever this says.
        pad_id: input id written into padding when ``packed=False`` and samples differ in length
            (never a target, so any valid id works).
        num_workers: DataLoader worker processes per rank (0: load in the training process).

    Raises:
        ValueError: in the constructor, on a missing path, a bad sidecar or index, a ``dtype`` / ``eos_id``
            that is missing or contradicts the sidecar or index, ``seq_len < 1``, a ``val_fraction`` outside
            ``(0, 1)``, and the other checks of :class:`~lightning_cp.data.TokenFileDataset`; at ``setup``, on
            an id ``>= vocab_size``, an ``eos_id`` that never occurs, or a ``val_fraction`` that leaves no
            training sample.
    """

    def __init__(
        self,
        path: str,
        vocab_size: int,
        seq_len: int = 1024,
        dtype: TokenDType | None = None,
        eos_id: int | None = None,
        val_fraction: float = 0.01,
        batch_size: int = 8,
        packed: bool = False,
        shuffle: bool = True,
        pad_id: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            batch_size=batch_size, packed=packed, shuffle=shuffle, num_workers=num_workers, pad_id=pad_id
        )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"val_fraction={val_fraction} must be in (0, 1); to skip validation keep a small fraction "
                "and set Trainer(limit_val_batches=0)."
            )
        self._megatron = _is_megatron_prefix(path)
        if self._megatron:
            _check_megatron_arguments(path, seq_len, dtype, vocab_size, eos_id)
        else:
            _check_token_file(path, seq_len, dtype, vocab_size, eos_id)
        self.save_hyperparameters()
        self.path = path
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.dtype = dtype
        self.eos_id = eos_id
        self.val_fraction = val_fraction

    def setup(self, stage: str) -> None:
        """Scan the file once (ids, documents), then split its samples into the train and validation sets."""
        if self._train is not None:
            return
        if self._megatron:
            dataset = MegatronIndexedDataset(self.path, seq_len=self.seq_len, vocab_size=self.vocab_size)
        else:
            dataset = TokenFileDataset(
                self.path,
                seq_len=self.seq_len,
                dtype=self.dtype,
                vocab_size=self.vocab_size,
                eos_id=self.eos_id,
            )
        num_val = max(1, round(self.val_fraction * len(dataset)))
        if num_val >= len(dataset):
            raise ValueError(
                f"val_fraction={self.val_fraction} of the {len(dataset)} samples in path={self.path!r} "
                "leaves no training sample; use a smaller val_fraction, a smaller seq_len or a larger file."
            )
        self._train = Subset(dataset, range(len(dataset) - num_val))
        self._val = Subset(dataset, range(len(dataset) - num_val, len(dataset)))


def _check_megatron_arguments(
    prefix: str, seq_len: int, dtype: TokenDType | None, vocab_size: int, eos_id: int | None
) -> None:
    """The checks of a Megatron indexed dataset that read its index and a sample of its ids, and of the
    arguments that only flat files take."""
    _check_seq_len(seq_len)
    index = _MegatronIndex.read(prefix)
    if eos_id is not None:
        raise ValueError(
            f"eos_id={eos_id}: the documents of the Megatron indexed dataset path={prefix!r} come from "
            f"{prefix}.idx; leave eos_id unset (null)."
        )
    if dtype is not None and np.dtype(dtype) != index.dtype:
        raise ValueError(
            f"dtype={dtype!r} contradicts {prefix}.idx, which records {index.dtype.name} ids; leave dtype "
            "unset (null)."
        )
    _check_sampled_ids(prefix + ".bin", index.dtype, vocab_size)
