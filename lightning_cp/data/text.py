"""``TextDataModule``: local text or chat files, tokenized once, packed into rows of ``seq_len`` tokens.

The files (``.jsonl`` / ``.json`` / ``.parquet`` / ``.arrow``) are read with Hugging Face ``datasets`` (the
``data`` extra) and tokenized by a local ``transformers`` tokenizer (:mod:`lightning_cp.data.tokenization`).
Tokenization runs once, in ``prepare_data`` (Lightning calls it on each node's local rank 0 before the
other ranks start ``setup``); ``datasets`` caches the result under a fingerprint of the file, the tokenizer's
files and the options, and every rank's ``setup`` reads that cache. ``setup`` then splits off the
validation documents or conversations (a seeded fraction, or a file of its own; the samples of one
conversation stay together) and packs each split
(:func:`~lightning_cp.data.packing.pack_documents`), the same way on every rank.

An item of the datasets is one row: the list of its document pieces, each ``{"input_ids": int64 [L],
"loss_mask": float32 [L]}``. A batch is ``batch_size`` rows as one packed ``[1, T]`` row with
``cu_seqlens`` (one entry per piece, ``T <= batch_size * seq_len``), so every piece is its own sequence:
positions restart and no token predicts across a boundary (the strategy's ``shard_batch`` makes the
next-token labels per sequence).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset

from lightning_cp.constants import INPUT_IDS, LOSS_MASK
from lightning_cp.data.chat_messages import normalize_messages
from lightning_cp.data.collate import collate_packed
from lightning_cp.data.datamodule import _CPDataModule
from lightning_cp.data.packing import Piece, pack_documents
from lightning_cp.data.text_files import (
    LENGTH,
    check_file,
    check_first_record,
    load_records,
    record_location,
    tokenize_records,
)
from lightning_cp.data.tokenization import (
    TextFormat,
    chat_targets,
    load_tokenizer,
    stop_tokens,
    tokenize_conversations,
    tokenize_texts,
)

_CACHE_VERSION = "2"
"""Bumped when the tokenized columns change meaning, so older caches are not read."""


@dataclass(frozen=True)
class PackingSummary:
    """What a split holds after tokenization and packing (logged at ``setup``)."""

    documents: int
    """Documents (or conversations) of the split before any was dropped."""
    samples: int
    """Their samples: one per document; a conversation gives several where the chat template rewrites its
    earlier turns (:func:`~lightning_cp.data.chat_turns.turn_samples`)."""
    dropped: int
    """Samples left out for their length: longer than ``seq_len`` (``overlong="drop"``), or without a target
    token in their first ``seq_len`` tokens (a prompt that alone fills ``seq_len``)."""
    untrained: int
    """Samples left out without any target token (a conversation without an assistant message)."""
    truncated: int
    """Samples cut to their first ``seq_len`` tokens (``overlong="truncate"``)."""
    split: int
    """Documents longer than ``seq_len`` cut into pieces (``format="text"``)."""
    tokens: int
    """Tokens in the rows."""
    rows: int
    """Packed rows."""
    seq_len: int

    @property
    def efficiency(self) -> float:
        """Real tokens / row capacity (``tokens / (rows * seq_len)``)."""
        return self.tokens / max(1, self.rows * self.seq_len)

    def __str__(self) -> str:
        return (
            f"{self.documents} documents{_as_samples(self.documents, self.samples)}, {self.tokens} tokens in {self.rows} rows of {self.seq_len}, packing "
            f"efficiency {self.efficiency:.1%}; dropped {self.dropped} (length), {self.untrained} without an "
            f"assistant reply, truncated {self.truncated}, split {self.split}"
        )


class PackedRows(Dataset):
    """Rows of document pieces read from a tokenized ``datasets.Dataset`` (memory-mapped ``arrow``).

    Item ``i`` is a list of ``{"input_ids": int64 [L], "loss_mask": float32 [L]}``, one per piece of row
    ``i``; ``loss_mask`` is all ones for documents without a ``loss_mask`` column (``format="text"``).
    """

    def __init__(self, documents: Any, rows: list[list[Piece]]) -> None:
        self.documents = documents
        self.rows = rows
        self._has_mask = LOSS_MASK in documents.column_names

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[dict[str, torch.Tensor]]:
        pieces = []
        for piece in self.rows[index]:
            document = self.documents[piece.document]
            span = slice(piece.start, piece.start + piece.length)
            ids = torch.tensor(document[INPUT_IDS][span], dtype=torch.int64)
            if self._has_mask:
                mask = torch.tensor(document[LOSS_MASK][span], dtype=torch.float32)
            else:
                mask = torch.ones(piece.length, dtype=torch.float32)
            pieces.append({INPUT_IDS: ids, LOSS_MASK: mask})
        return pieces


def collate_rows(rows: list[list[dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The pieces of ``rows`` (items of :class:`PackedRows`) as one packed batch (:func:`collate_packed`)."""
    return collate_packed([piece for row in rows for piece in row])


class TextDataModule(_CPDataModule):
    """Fine-tuning or continued pre-training on local text or chat files, packed into rows of ``seq_len``.

    ``format="text"``: a ``text`` column (``column``) of documents, each tokenized with the tokenizer's
    special tokens and ended by EOS; every token is a target. A document longer than ``seq_len`` is cut
    into rows of ``seq_len`` tokens and a last piece; the others are packed whole, best-fit decreasing.

    ``format="chat"``: a ``messages`` column of conversations (lists of ``{"role": ..., "content": ...}``, or
    ShareGPT's ``{"from": "human" | "gpt" | "system", "value": ...}``, read as user / assistant / system),
    rendered with the tokenizer's chat template; the only targets are the assistant's replies: the tokens
    the template's ``{% generation %}`` blocks mark, or, for a template without them, each assistant turn as
    the template renders it at inference, after its generation prompt, through its end-of-turn token
    (:data:`~lightning_cp.data.tokenization.ChatTargets`, :mod:`~lightning_cp.data.chat_turns`; ``setup``
    logs which). A conversation is one sample, or, where the template rewrites earlier turns (Qwen3's,
    Qwen3.5's, gpt-oss's, GLM-4-MoE's), one sample per turn, each with its own prompt. A sample longer
    than ``seq_len`` is dropped (``overlong="drop"``) or cut to its first ``seq_len`` tokens
    (``"truncate"``); one without a target token left is dropped (under either ``overlong``, one whose prompt
    alone fills ``seq_len``), and counted. Each sample is packed whole.

    Validation: ``val_path``, a file of its own, or else a seeded ``val_fraction`` of the documents (at least
    one; a conversation's samples all on one side) held out before packing. ``batch_size`` counts rows per data-parallel rank; the loaders are
    :class:`~lightning_cp.data.ResumableDataLoader` (exact mid-epoch resume). ``setup`` logs a
    :class:`PackingSummary` per split and keeps it in ``summary``.

    Args:
        path: the training file: ``.jsonl``, ``.json``, ``.parquet`` or ``.arrow``.
        tokenizer: a local tokenizer directory (``save_pretrained``; usually the model's own directory).
        seq_len: tokens per packed row (a multiple of ``2 * cp`` wastes no padding in the CP split).
        format: ``"text"`` or ``"chat"`` (see above).
        column: the column to read; ``None``: ``"text"`` or ``"messages"``.
        val_fraction: share of the documents held out for validation, in ``(0, 1)``; ``None``: 0.01, or
            none when ``val_path`` is set (both set is an error).
        val_path: a validation file of the same format and column.
        overlong: ``format="chat"``: ``"drop"`` or ``"truncate"`` samples longer than ``seq_len``.
        chat_template_kwargs: ``format="chat"``: variables of every rendering of the chat template
            (``{"enable_thinking": True}`` for reasoning data on Qwen3.5's small models, gpt-oss's
            ``reasoning_effort``, ...).
        batch_size: packed rows per batch on each data-parallel rank.
        shuffle: shuffle the training rows in a single process (under a distributed strategy Lightning's
            ``DistributedSampler`` shuffles them, seeded).
        seed: seed of the validation fraction's draw.
        cache_dir: where ``datasets`` keeps the tokenized files; ``None``: its default (``HF_DATASETS_CACHE``).
        num_workers: DataLoader worker processes per rank (0: load in the training process).

    Raises:
        ImportError: ``datasets`` or ``transformers`` is missing (``pip install 'lightning-cp[hf,data]'``).
        ValueError: one line naming the argument (and the file's line where there is one) and the fix. In the
            constructor: a missing file or one of another type, an empty file, a first JSON line that is not
            UTF-8, not a JSON object or without ``column`` (or a conversation that is no list of messages),
            an unknown ``format`` or ``overlong``, ``seq_len < 2``, a bad ``val_fraction``, both
            ``val_fraction`` and ``val_path``, a tokenizer directory that does not load, without EOS
            (``text``) or without a chat template (``chat``). At ``prepare_data`` / ``setup``: a file with no
            record, a JSON line that is not UTF-8 or not an object, a missing column, a record that is no
            document or conversation (a ShareGPT sender other than human / gpt / system), a conversation the
            chat template fails on, a turn a template without ``{% generation %}`` blocks renders otherwise
            than its generation prompt leads into (``chat_template_kwargs`` to set), a conversation that
            opens with the assistant, a chat file without any assistant reply, or a split left without
            documents.
    """

    def __init__(
        self,
        path: str,
        tokenizer: str,
        seq_len: int = 2048,
        format: TextFormat = "text",
        column: str | None = None,
        val_fraction: float | None = None,
        val_path: str | None = None,
        overlong: Literal["drop", "truncate"] = "drop",
        batch_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        cache_dir: str | None = None,
        num_workers: int = 0,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            batch_size=batch_size, packed=True, shuffle=shuffle, num_workers=num_workers, collate=collate_rows
        )
        if format not in ("text", "chat"):
            raise ValueError(f"format={format!r} is not supported; use 'text' or 'chat'.")
        if overlong not in ("drop", "truncate"):
            raise ValueError(f"overlong={overlong!r} is not supported; use 'drop' or 'truncate'.")
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len} must be at least 2 (a token and its target).")
        read_column = column or ("text" if format == "text" else "messages")
        for name, file in (("path", path), ("val_path", val_path)):
            if file is not None:
                check_file(name, file)
                check_first_record(name, file, read_column, chat=format == "chat")
        if val_path is not None and val_fraction is not None:
            raise ValueError(
                f"val_fraction={val_fraction} and val_path={val_path!r} are both set; validate on the file "
                "(val_fraction: null) or on a fraction of path (val_path: null)."
            )
        if val_path is None:
            val_fraction = 0.01 if val_fraction is None else val_fraction
            if not 0.0 < val_fraction < 1.0:
                raise ValueError(f"val_fraction={val_fraction} must be in (0, 1), or set val_path.")
        if importlib.util.find_spec("datasets") is None:
            raise ImportError("TextDataModule needs datasets: pip install 'lightning-cp[data]'.")
        self._tokenizer = load_tokenizer(tokenizer, format)
        self.chat_targets = chat_targets(self._tokenizer, tokenizer) if format == "chat" else None
        self.stop_tokens = stop_tokens(self._tokenizer, tokenizer) if format == "chat" else frozenset()
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.save_hyperparameters()
        self.path, self.tokenizer, self.seq_len, self.format = path, tokenizer, seq_len, format
        self.column = read_column
        self.val_fraction, self.val_path, self.overlong = val_fraction, val_path, overlong
        self.seed, self.cache_dir = seed, cache_dir
        self.vocab_size = len(self._tokenizer)
        self.summary: dict[str, PackingSummary] = {}

    def prepare_data(self) -> None:
        """Tokenize the files into ``datasets``' cache (each node's local rank 0, before ``setup``)."""
        for name, file in (("path", self.path), ("val_path", self.val_path)):
            if file is not None:
                self._tokenized(name, file)

    def setup(self, stage: str) -> None:
        """Read the tokenized files from the cache, split off validation, pack both splits; log the summary."""
        if self._train is not None:
            return
        if self.chat_targets is not None:
            stops = self._tokenizer.convert_ids_to_tokens(sorted(self.stop_tokens))
            rank_zero_info(
                f"TextDataModule chat targets: {_CHAT_TARGETS[self.chat_targets]}; stop tokens {stops}"
            )
        documents = self._tokenized("path", self.path)
        if self.val_path is None:
            owners = _column(documents, "conversation")
            sources = np.unique(owners)
            num_val = max(1, round(self.val_fraction * len(sources)))
            if num_val >= len(sources):
                raise ValueError(
                    f"val_fraction={self.val_fraction} of the {len(sources)} documents of path={self.path!r} "
                    "leaves none for training; use a smaller val_fraction or a larger file."
                )
            order = np.random.default_rng(self.seed).permutation(len(sources))
            held_out = np.isin(owners, sources[order[:num_val]])
            splits = {
                "train": (documents, np.flatnonzero(~held_out)),
                "val": (documents, np.flatnonzero(held_out)),
            }
        else:
            val_documents = self._tokenized("val_path", self.val_path)
            splits = {
                "train": (documents, np.arange(len(documents))),
                "val": (val_documents, np.arange(len(val_documents))),
            }
        datasets = {}
        for name, (source, selected) in splits.items():
            datasets[name], self.summary[name] = self._pack(source, selected)
            if len(datasets[name]) == 0:
                raise _empty_split(name, self.summary[name])
            rank_zero_info(f"TextDataModule {name}: {self.summary[name]}")
        self._train, self._val = datasets["train"], datasets["val"]

    def _pack(self, documents: Any, selected: np.ndarray) -> tuple[PackedRows, PackingSummary]:
        """Pack ``documents[selected]``: chat samples kept, cut or dropped by ``overlong``."""
        lengths = _column(documents, LENGTH)[selected]
        count = len(np.unique(_column(documents, "conversation")[selected]))
        samples, dropped, untrained, truncated = len(selected), 0, 0, 0
        if self.format == "chat":
            first_target = _column(documents, "first_target")[selected]
            trained = first_target >= 0
            too_long = lengths > self.seq_len
            if self.overlong == "truncate":
                truncated = int((too_long & (first_target < self.seq_len)).sum())
                lengths = np.minimum(lengths, self.seq_len)
                keep = trained & (first_target < self.seq_len)
            else:
                keep = trained & ~too_long
            untrained = int((~trained).sum())
            dropped = int((~keep).sum()) - untrained
            selected, lengths = selected[keep], lengths[keep]
        rows = pack_documents(lengths.tolist(), self.seq_len)
        rows = [[Piece(int(selected[p.document]), p.start, p.length) for p in row] for row in rows]
        summary = PackingSummary(
            documents=count,
            samples=samples,
            dropped=dropped,
            untrained=untrained,
            truncated=truncated,
            split=int((lengths > self.seq_len).sum()),
            tokens=int(lengths.sum()),
            rows=len(rows),
            seq_len=self.seq_len,
        )
        return PackedRows(documents, rows), summary

    def _tokenized(self, name: str, file: str) -> Any:
        """The tokenized ``datasets.Dataset`` of ``file`` (the argument ``name``), a row per sample:
        ``input_ids``, ``length``, ``conversation`` (the record it comes from); chat: ``loss_mask``,
        ``first_target``. From the cache when an equal file, tokenizer and options were tokenized before."""
        raw = load_records(name, file, self.cache_dir)
        if self.column not in raw.column_names:
            raise ValueError(
                f"{name}={file!r} has no column {self.column!r} (its columns: {raw.column_names}); set column to "
                f"the one holding the {'conversations' if self.format == 'chat' else 'documents'}."
            )
        tokenizer, chat = self._tokenizer, self.format == "chat"

        def tokenize(values: list[Any], indices: list[int]) -> dict[str, list]:
            if chat:
                out = tokenize_conversations(
                    tokenizer, values, indices, self.chat_targets, self.stop_tokens, self.chat_template_kwargs
                )
            else:
                out = tokenize_texts(tokenizer, values, indices)
                out["conversation"] = list(indices)
            if chat:
                out["first_target"] = [
                    next((i for i, m in enumerate(mask) if m), -1) for mask in out[LOSS_MASK]
                ]
            return out

        options = json.dumps(self.chat_template_kwargs, sort_keys=True, default=repr)
        documents = tokenize_records(
            name,
            file,
            raw,
            tokenize,
            tokenizer=self.tokenizer,
            key=(self.format, self.column, options, _CACHE_VERSION),
            description=self.format,
            column=self.column,
        )
        if chat and _column(documents, "first_target").max() < 0:
            roles = [message["role"] for message in normalize_messages(raw[0][self.column])]
            raise ValueError(
                f"{name}={file!r}: none of its {len(raw)} conversations has an assistant reply to train on "
                f"({record_location(name, file, 0)} has the roles {roles}); format='chat' trains on the messages "
                "of role 'assistant' (ShareGPT: from 'gpt'): rename the replies' role, or use format='text'."
            )
        return documents


_CHAT_TARGETS = {
    "generation": "the tokens the chat template's {% generation %} blocks mark",
    "turns": "each assistant turn as the chat template renders it at inference, after its generation prompt, "
    "through its end-of-turn token (the template has no {% generation %} blocks): one sample per conversation, "
    "or per turn where the template rewrites earlier turns",
}


def _column(documents: Any, name: str) -> np.ndarray:
    """A column of integers of a ``datasets.Dataset`` as an ``int64`` array (read as one list: converting
    ``datasets``' lazy column takes a Python call per row)."""
    return np.asarray(documents[name][:], dtype=np.int64)


def _as_samples(documents: int, samples: int) -> str:
    return "" if samples == documents else f" as {samples} samples"


def _empty_split(name: str, summary: PackingSummary) -> ValueError:
    """The error of a split left without documents, with the advice that fits why."""
    if summary.untrained == summary.samples:
        advice = "none has an assistant reply: give the conversations messages of role 'assistant'"
    else:
        advice = "use overlong='truncate', a larger seq_len or more data"
    return ValueError(f"TextDataModule: the {name} split has no document left ({summary}); {advice}.")
