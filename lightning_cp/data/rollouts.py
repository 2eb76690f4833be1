"""``RolloutDataModule``: reinforcement-learning rollouts (a prompt and a sampled completion each) as batches.

Each rollout becomes one sample of the batch contract with completion-only targets and the values the policy
losses read, every one of them aligned with ``input_ids`` (the value at position ``t`` is about token ``t``,
Hugging Face's ``labels`` convention, *not* shifted)::

    input_ids      p_0 ... p_{P-1}  c_0 ... c_{C-1}     prompt ids, then completion ids (int64)
    loss_mask      0   ... 0        1   ... 1           1 on completion tokens (float32)
    advantages     0   ... 0        A   ... A           the rollout's advantage on its completion tokens
    old_logprobs   0   ... 0        l_0 ... l_{C-1}     l_j = log pi_old(c_j | tokens before it)
    ref_logprobs   0   ... 0        r_0 ... r_{C-1}     the same under the reference model
    rollout_index  i   ... i        i   ... i           the rollout's row in its file (0-based)

The off-by-one is the strategy's: ``shard_batch`` shifts ``labels``, ``loss_mask`` and the three float values
together (:data:`~lightning_cp.constants.TARGET_KEYS`), so after it the value at local position ``t`` belongs to
the label at ``t``, which is token ``t + 1``: the position that *predicts* ``c_j`` carries ``c_j``'s advantage
and log-probabilities. ``rollout_index`` is not shifted (it names the rollout of token ``t``).
``old_logprobs`` / ``ref_logprobs`` are present only when the rollouts carry them (a column of the file, or a
directory ``lightning-cp predict`` wrote: :mod:`lightning_cp.rollout_logprob_format`).

Advantages from rewards are GRPO's, over the whole file before any split, packing or data-parallel sharding:
for each group (a prompt's completions), ``A = (r - mean(group)) / (std(group) + 1e-4)`` with the unbiased
standard deviation (TRL's ``GRPOTrainer``, ``scale_rewards="group"``, formerly ``True``), or ``A = r - mean(group)``
(``normalize="mean"``, Dr. GRPO, arXiv:2503.20783). A rollout is never cut (a sequence-level ratio needs all of
its tokens): one longer than ``seq_len`` is refused.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from typing import Any, Literal

import numpy as np
from torch.utils.data import DataLoader

from lightning_cp.constants import INPUT_IDS
from lightning_cp.data.datamodule import _CPDataModule
from lightning_cp.data.packing import pack_documents
from lightning_cp.data.rollout_logprobs import read_logprob_dir
from lightning_cp.data.rollout_records import (
    GROUP,
    IS_REWARD,
    LOGPROB_KEYS,
    PROMPT_LENGTH,
    SCORE,
    ChatRendering,
    RolloutForm,
    rollout_form,
    rollout_row,
)
from lightning_cp.data.rollout_samples import RolloutSamples, collate_rollouts, data_parallel_sampler
from lightning_cp.data.text_files import (
    LENGTH,
    check_file,
    file_columns,
    first_json_record,
    load_records,
    record_location,
    tokenize_records,
)
from lightning_cp.data.tokenization import (
    RecordError,
    chat_targets,
    load_tokenizer,
    stop_tokens,
)
from lightning_cp.rollout_logprob_format import check_logprob_dir

Normalize = Literal["std", "mean"]
"""How rewards become advantages within a group: ``"std"`` (GRPO) or ``"mean"`` (Dr. GRPO)."""
ADVANTAGE_EPSILON = 1e-4
"""Added to a group's standard deviation (TRL's constant): a group of equal rewards gets advantages 0."""
_CACHE_VERSION = "1"
"""Bumped when the tokenized columns change meaning, so older caches are not read."""


def grpo_advantages(rewards: np.ndarray, groups: np.ndarray, normalize: Normalize = "std") -> np.ndarray:
    """GRPO's advantage of every rollout from the rewards of its group.

    Args:
        rewards: ``[N]`` finite rewards.
        groups: ``[N]`` the group of every rollout (any values ``np.unique`` orders); each group has at least two
            rollouts.
        normalize: ``"std"``: ``(r - mean) / (std + 1e-4)``, the unbiased (``N - 1``) std of the group;
            ``"mean"``: ``r - mean``.

    Returns:
        ``[N]`` float64 advantages.
    """
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    rewards = np.asarray(rewards, dtype=np.float64)
    centered = rewards - (np.bincount(inverse, weights=rewards) / counts)[inverse]
    if normalize == "mean":
        return centered
    std = np.sqrt(np.bincount(inverse, weights=centered**2) / (counts - 1))
    return centered / (std[inverse] + ADVANTAGE_EPSILON)


class RolloutDataModule(_CPDataModule):
    """Rollouts of a policy (a prompt and one sampled completion each, with a reward or an advantage) as
    batches whose only targets are the completions' tokens, for the policy losses of
    :class:`~lightning_cp.CPLossMixin`.

    A file (``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow``, read with ``datasets``) holds one rollout per
    record, in one of two forms (:mod:`~lightning_cp.data.rollout_records`):

    - token ids: ``{"prompt_ids": [int, ...], "completion_ids": [int, ...], "reward": float}``; no tokenizer
      needed;
    - text: ``{"prompt": [{"role": "user", "content": ...}, ...], "completion": str, "reward": float}``,
      rendered with the tokenizer's chat template as at inference: the prompt's messages with the generation
      prompt, then the completion through its end-of-turn token, which are the completion tokens
      (:func:`~lightning_cp.data.chat_turns.turn_samples`).

    Either form: ``reward`` or ``advantage`` (exactly one, finite); optional ``old_logprobs`` / ``ref_logprobs``
    (one log-probability per completion token, as tokenized here, each finite and at most 0) and ``group`` (the
    prompt's id, any JSON value; without it, rollouts with the same prompt token ids are a group).

    Batches follow the module docstring's per-token layout (:mod:`lightning_cp.data.rollouts`). ``packed``:
    ``batch_size`` rows of at most ``seq_len`` tokens per data-parallel rank as one ``[1, T]`` row with
    ``cu_seqlens``, whole rollouts packed best-fit decreasing (:func:`~lightning_cp.data.pack_documents`); else
    ``batch_size`` rollouts per batch, right-padded ``[B, S]``. The advantages are computed over the whole
    file before any of this (see the module docstring for GRPO's formula and ``normalize``).

    Loaders: ``train_dataloader`` serves ``path`` (shuffled); validation and test serve ``val_path`` (none
    without it: RL steps on the rollouts it has). Under a distributed strategy each serves every rollout once
    per epoch over the data-parallel ranks, where Lightning's ``DistributedSampler`` would repeat some to even
    the ranks out: a short rank's last batch is a padding token without target, which no loss or metric counts
    (:mod:`~lightning_cp.data.rollout_samples`), so every step is the unsharded global batch's.
    ``predict_dataloader`` serves every rollout of ``path`` once, unshuffled (a padded batch: in file order;
    packed: in the rows' order), which is what :class:`~lightning_cp.callbacks.RolloutLogprobWriter`
    (``lightning-cp predict``) writes the per-token log-probabilities of and ``old_logprobs`` /
    ``ref_logprobs`` read back.

    Args:
        path: the rollout file.
        tokenizer: a local tokenizer directory: needed for text rollouts; for token ids it checks every id
            against its size and sets ``vocab_size``. ``None``: ``vocab_size`` is ``None`` and ids are not
            checked against a vocabulary (the model's embedding refuses an id beyond it).
        seq_len: the longest rollout (prompt + completion tokens) and, packed, a row's capacity.
        packed: packed ``[1, T]`` batches, or padded ``[B, S]``.
        normalize: ``"std"`` (GRPO) or ``"mean"`` (Dr. GRPO): how rewards become advantages.
        old_logprobs: a directory ``lightning-cp predict`` wrote for ``path`` with the sampling policy's weights
            (its ``logprobs.dp<r>.jsonl``), whose log-probabilities become ``old_logprobs``; ``None``: the file's
            ``old_logprobs`` column, if any.
        ref_logprobs: the same, with the reference model's weights, for ``ref_logprobs``.
        val_path: a validation file of rollouts (its own column ``old_logprobs`` / ``ref_logprobs`` only).
        batch_size: packed rows (``packed``) or rollouts per batch on each data-parallel rank.
        shuffle: shuffle the training rollouts (rows) in a single process (under a distributed strategy they
            are always shuffled, seeded as Lightning seeds its sampler, the same order for every DP x CP layout).
        pad_id: ``packed=False``: the id written into padding (never a target).
        chat_template_kwargs: text rollouts: variables of every rendering of the chat template.
        cache_dir: where ``datasets`` keeps the read and tokenized files; ``None``: its default.
        num_workers: DataLoader worker processes per rank.

    Raises:
        ImportError: ``datasets`` (or, with ``tokenizer``, ``transformers``) is missing.
        ValueError: one line naming the argument, the file's line (row) and the fix. In the constructor: a
            missing file or one of another type, a bad ``normalize`` or ``seq_len``, a tokenizer directory that
            does not load or, for text, has no chat template, a log-prob directory without
            ``logprobs.dp<r>.jsonl``, or a first JSON line that shows one of the errors below. At
            ``prepare_data`` / ``setup``: a file with the columns of both forms or neither, a record without its
            prompt or completion, an empty prompt or completion, ids that are not ints (or not below the
            tokenizer's size), both or neither of ``reward`` and ``advantage``, a NaN or infinite one, a file that
            mixes rewards and advantages, a log-prob list whose length is not the completion's or that holds a
            value that is not finite or above 0, a rollout longer than ``seq_len``, a group of one rollout (its
            advantage is undefined), a column ``old_logprobs`` / ``ref_logprobs`` together with the directory of
            the same name, and a log-prob directory that misses rollouts, holds one twice or was written for
            other tokens (:func:`~lightning_cp.data.rollout_logprobs.read_logprob_dir`).

    Example (YAML for ``lightning-cp fit``)::

        data:
          class_path: lightning_cp.data.RolloutDataModule
          init_args: {path: rollouts.jsonl, tokenizer: runs/tiny, seq_len: 512, ref_logprobs: runs/ref/predictions}
    """

    def __init__(
        self,
        path: str,
        tokenizer: str | None = None,
        seq_len: int = 2048,
        packed: bool = True,
        normalize: Normalize = "std",
        old_logprobs: str | None = None,
        ref_logprobs: str | None = None,
        val_path: str | None = None,
        batch_size: int = 1,
        shuffle: bool = True,
        pad_id: int = 0,
        chat_template_kwargs: dict[str, Any] | None = None,
        cache_dir: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            packed=packed,
            shuffle=shuffle,
            num_workers=num_workers,
            pad_id=pad_id,
            collate=functools.partial(collate_rollouts, packed=packed, pad_id=pad_id),
        )
        if normalize not in ("std", "mean"):
            raise ValueError(
                f"normalize={normalize!r} is not supported; use 'std' (GRPO) or 'mean' (Dr. GRPO)."
            )
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len} must be at least 2 (a prompt token and a completion token).")
        if importlib.util.find_spec("datasets") is None:
            raise ImportError("RolloutDataModule needs datasets: pip install 'lightning-cp[data]'.")
        self.logprob_dirs = {
            key: directory
            for key, directory in zip(LOGPROB_KEYS, (old_logprobs, ref_logprobs), strict=True)
            if directory is not None
        }
        for key, directory in self.logprob_dirs.items():
            check_logprob_dir(key, directory)
        self._tokenizer = None if tokenizer is None else load_tokenizer(tokenizer, "chat")
        self.vocab_size = None if self._tokenizer is None else len(self._tokenizer)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.save_hyperparameters()
        self.path, self.tokenizer, self.seq_len, self.normalize = path, tokenizer, seq_len, normalize
        self.val_path, self.cache_dir, self.pad_id = val_path, cache_dir, pad_id
        for name, file in (("path", path), ("val_path", val_path)):
            if file is not None:
                check_file(name, file)
                self._check_first_record(name, file)

    def prepare_data(self) -> None:
        """Tokenize the files into ``datasets``' cache (each node's local rank 0, before ``setup``)."""
        for name, file in (("path", self.path), ("val_path", self.val_path)):
            if file is not None:
                self._tokenized(name, file)

    def setup(self, stage: str) -> None:
        """Read the tokenized files, compute the advantages, join the log-prob directories, pack."""
        if self._train is not None:
            return
        self._train = self._samples("path", self.path, self.logprob_dirs)
        self._val = None if self.val_path is None else self._samples("val_path", self.val_path, {})

    def train_dataloader(self) -> DataLoader:
        """``path``'s rollouts (rows), each once per epoch on one data-parallel rank: under a distributed
        strategy an :class:`~lightning_cp.data.rollout_samples.UnrepeatedDistributedSampler` (shuffled, as
        Lightning shuffles training data), whose short ranks get a batch without targets instead of a
        repeated rollout; ``shuffle`` alone otherwise."""
        return self._rollout_loader(self._train, training=True)

    def val_dataloader(self) -> DataLoader | list:
        """``val_path``'s rollouts, each once (unshuffled, as :meth:`train_dataloader` splits them), or no
        loader (Lightning then skips validation) without it."""
        return [] if self.val_path is None else self._rollout_loader(self._val, training=False)

    def test_dataloader(self) -> DataLoader | list:
        """As :meth:`val_dataloader`."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """Every rollout of ``path`` once, unshuffled (Lightning splits them over the data-parallel ranks)."""
        return self._loader(self._train, shuffle=False)

    def logprob_keys(self, name: str) -> list[str] | None:
        """The log-prob keys (``old_logprobs``, ``ref_logprobs``) that the batches of ``path`` or ``val_path``
        (``name``) carry: the directories given (``path`` only) and the file's columns, read without its
        records (:func:`~lightning_cp.data.text_files.file_columns`). ``None`` where the file is not set, or
        its columns are known only once it is read (a ``.json`` array)."""
        file = self.path if name == "path" else self.val_path
        columns = None if file is None else file_columns(name, file)
        if columns is None:
            return None
        directories = list(self.logprob_dirs) if name == "path" else []
        return sorted({*self._logprob_columns(name, file, columns), *directories})

    def _rollout_loader(self, dataset: RolloutSamples | None, training: bool) -> DataLoader:
        sampler = None if dataset is None else data_parallel_sampler(self.trainer, dataset, shuffle=training)
        if sampler is None:
            return self._loader(dataset, shuffle=training and self.shuffle)
        return self._loader(dataset, shuffle=False, sampler=sampler)

    def _check_first_record(self, name: str, file: str) -> None:
        """The errors the first record of a JSON-lines file shows, before launch."""
        first = first_json_record(name, file)
        if first is None:
            return
        location, record = first
        form = rollout_form([key for key, value in record.items() if value is not None], name, file)
        keys = self._logprob_columns(name, file, record)
        try:
            row = rollout_row(record, form, self.vocab_size, self._rendering(form, name, file), keys)
        except ValueError as error:
            raise ValueError(f"{name}={file!r} {location}: {error}") from None
        if len(row[INPUT_IDS]) > self.seq_len:
            raise self._too_long(name, file, location, len(row[INPUT_IDS]))

    def _logprob_columns(self, name: str, file: str, columns: Any) -> list[str]:
        """The log-prob columns of a file with ``columns``, refused where a directory gives the same values."""
        keys = [key for key in LOGPROB_KEYS if key in columns]
        both = [key for key in keys if name == "path" and key in self.logprob_dirs]
        if both:
            raise ValueError(
                f"{both[0]}={self.logprob_dirs[both[0]]!r} and the column {both[0]!r} of {name}={file!r} both give "
                f"the rollouts' {both[0]}; drop the column or the argument."
            )
        return keys

    def _rendering(self, form: RolloutForm, name: str, file: str) -> ChatRendering | None:
        """How text rollouts are rendered (``None`` for token ids)."""
        if form == "ids":
            return None
        if self._tokenizer is None:
            raise ValueError(
                f"{name}={file!r} holds text rollouts (prompt / completion), which need a tokenizer with a chat "
                "template; pass tokenizer (a local directory), or write prompt_ids / completion_ids."
            )
        chat_targets(self._tokenizer, self.tokenizer)  # refuses a tokenizer without a chat template
        stops = stop_tokens(self._tokenizer, self.tokenizer)
        return ChatRendering(self._tokenizer, stops, self.chat_template_kwargs)

    def _tokenized(self, name: str, file: str) -> Any:
        """The rollouts of ``file`` as a ``datasets.Dataset``, a row per record: ``input_ids``,
        ``prompt_length``, ``length``, ``score``, ``is_reward``, ``group`` and the log-prob columns. From the
        cache when an equal file, tokenizer and options were tokenized before."""
        raw = load_records(name, file, self.cache_dir)
        form = rollout_form(raw.column_names, name, file)
        chat = self._rendering(form, name, file)
        keys = self._logprob_columns(name, file, raw.column_names)
        columns = [INPUT_IDS, PROMPT_LENGTH, SCORE, IS_REWARD, GROUP, *keys]

        def tokenize(records: dict[str, list], indices: list[int]) -> dict[str, list]:
            rows = []
            for offset, index in enumerate(indices):
                record = {column: values[offset] for column, values in records.items()}
                try:
                    rows.append(rollout_row(record, form, self.vocab_size, chat, keys))
                except ValueError as error:
                    raise RecordError(index, str(error)) from None
            return {column: [row[column] for row in rows] for column in columns}

        options = json.dumps(
            [form, keys, self.vocab_size, self.chat_template_kwargs], sort_keys=True, default=repr
        )
        return tokenize_records(
            name,
            file,
            raw,
            tokenize,
            tokenizer=self.tokenizer,
            key=(options, _CACHE_VERSION),
            description="rollouts",
        )

    def _samples(self, name: str, file: str, logprob_dirs: dict[str, str]) -> RolloutSamples:
        """``file``'s rollouts checked for length, with advantages and the directories' log-probs, packed."""
        rollouts = self._tokenized(name, file)
        lengths = np.asarray(rollouts[LENGTH][:], dtype=np.int64)
        too_long = np.flatnonzero(lengths > self.seq_len)
        if len(too_long):
            first = int(too_long[0])
            raise self._too_long(name, file, record_location(name, file, first), int(lengths[first]))
        prompt_lengths = np.asarray(rollouts[PROMPT_LENGTH][:], dtype=np.int64)
        logprobs = {
            key: read_logprob_dir(key, directory, file, lambda i: rollouts[i][INPUT_IDS], prompt_lengths)
            for key, directory in logprob_dirs.items()
        }
        rows = None
        if self.packed:
            rows = [
                [piece.document for piece in row] for row in pack_documents(lengths.tolist(), self.seq_len)
            ]
        return RolloutSamples(rollouts, self._advantages(name, file, rollouts), logprobs, rows, self.pad_id)

    def _advantages(self, name: str, file: str, rollouts: Any) -> np.ndarray:
        """``[N]`` float32: the records' advantages, or GRPO's from their rewards (refusing a group of one)."""
        scores = np.asarray(rollouts[SCORE][:], dtype=np.float64)
        is_reward = np.asarray(rollouts[IS_REWARD][:], dtype=bool)
        other = np.flatnonzero(is_reward != is_reward[0])
        if len(other):
            kinds = {True: "a reward", False: "an advantage"}
            raise ValueError(
                f"{name}={file!r} {record_location(name, file, int(other[0]))} gives {kinds[not is_reward[0]]} "
                f"but {record_location(name, file, 0)} {kinds[bool(is_reward[0])]}; give every rollout of a file "
                "a reward (advantages from each group's rewards) or every one its advantage."
            )
        if not is_reward[0]:
            return scores.astype(np.float32)
        groups = np.asarray(rollouts[GROUP][:])
        _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
        single = np.flatnonzero(counts[inverse] == 1)
        if len(single):
            first = int(single[0])
            group = groups[first]
            which = f"group {group.removeprefix('group:')}" if group.startswith("group:") else "its prompt"
            raise ValueError(
                f"{name}={file!r} {record_location(name, file, first)} is the only rollout of {which}: its GRPO "
                "advantage (its reward against the others of its group) is undefined; sample at least two "
                "completions per prompt (the same 'group' or prompt), drop it, or give 'advantage' instead of "
                "'reward'."
            )
        return grpo_advantages(scores, groups, self.normalize).astype(np.float32)

    def _too_long(self, name: str, file: str, location: str, length: int) -> ValueError:
        return ValueError(
            f"{name}={file!r} {location} is a rollout of {length} tokens, longer than seq_len={self.seq_len}; a "
            f"rollout is never cut (a sequence-level ratio needs all of it): set seq_len to at least {length}, or "
            "drop the rollout."
        )
