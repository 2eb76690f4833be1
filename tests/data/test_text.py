"""``TextDataModule``: chat targets against the rendered template text, packed text documents, overlong
conversations, the validation split, the tokenization cache, exact mid-epoch resume and one-line errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_cp.constants import CU_SEQLENS, INPUT_IDS, LOSS_MASK
from lightning_cp.data import TextDataModule
from tests._trainer import quiet_trainer
from tests.data.test_resumable import _Recorder


def _module(tiny_chat_dir, tmp_path, file="chat.jsonl", **options) -> TextDataModule:
    options = {"format": "chat" if file.startswith("chat") else "text", "seq_len": 128, **options}
    data = TextDataModule(
        str(tiny_chat_dir / file), str(tiny_chat_dir), cache_dir=str(tmp_path / "cache"), **options
    )
    data.prepare_data()
    data.setup("fit")
    return data


def _records(tiny_chat_dir, file):
    return [json.loads(line) for line in (tiny_chat_dir / file).read_text().splitlines()]


def _pieces(dataset):
    """``(document, start, input_ids, loss_mask)`` of every piece the dataset serves, row by row."""
    for index in range(len(dataset)):
        for piece, sample in zip(dataset.rows[index], dataset[index]):
            yield piece.document, piece.start, sample[INPUT_IDS].tolist(), sample[LOSS_MASK].tolist()


def _reference_chat(tokenizer, messages):
    """Token ids of the rendered conversation, and 1 on the tokens inside an assistant message's rendered
    span (its content and the <|im_end|> that closes it, found in the text), via the tokenizer's offsets."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for message in messages:
        if message["role"] == "assistant":
            header = text.index("<|im_start|>assistant\n", cursor) + len("<|im_start|>assistant\n")
            rendered = message["content"] + "<|im_end|>"
            assert text.startswith(rendered, header)
            spans.append((header, header + len(rendered)))
            cursor = header + len(rendered)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start and end <= b for a, b in spans)) for start, end in encoded["offset_mapping"]]
    return encoded["input_ids"], mask


def test_chat_targets_are_exactly_the_assistant_tokens(tiny_chat_dir, tmp_path):
    data = _module(tiny_chat_dir, tmp_path)
    tokenizer = data._tokenizer
    records = _records(tiny_chat_dir, "chat.jsonl")
    seen = []
    for dataset in (data._train, data._val):
        for document, start, ids, mask in _pieces(dataset):
            reference_ids, reference_mask = _reference_chat(tokenizer, records[document]["messages"])
            assert start == 0 and ids == reference_ids, f"conversation {document} is not whole"
            assert mask == reference_mask, f"conversation {document}: targets differ from the assistant spans"
            seen.append(document)
    assert sorted(seen) == list(range(len(records)))  # each conversation once, in train or in val
    assert sum(sum(mask) for *_, mask in _pieces(data._train)) > 0
    assert data.summary["train"].documents + data.summary["val"].documents == len(records)
    assert data.summary["train"].dropped == data.summary["val"].dropped == 0


def test_text_documents_end_with_eos_and_only_longer_ones_are_split(tiny_chat_dir, tmp_path):
    seq_len = 24
    data = _module(tiny_chat_dir, tmp_path, file="text.jsonl", seq_len=seq_len, val_fraction=0.1)
    tokenizer = data._tokenizer
    texts = [record["text"] for record in _records(tiny_chat_dir, "text.jsonl")]
    expected = {i: tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for i, text in enumerate(texts)}
    assert any(len(ids) > seq_len for ids in expected.values())  # the case is exercised
    for name, dataset in (("train", data._train), ("val", data._val)):
        got: dict[int, list[tuple[int, list[int]]]] = {}
        for document, start, ids, mask in _pieces(dataset):
            assert mask == [1.0] * len(ids)
            got.setdefault(document, []).append((start, ids))
        for document, pieces in got.items():
            pieces.sort()
            assert [t for _, ids in pieces for t in ids] == expected[document]
            if len(expected[document]) <= seq_len:
                assert len(pieces) == 1, f"document {document} of {len(expected[document])} tokens was split"
            else:
                assert [len(ids) for _, ids in pieces[:-1]] == [seq_len] * (len(pieces) - 1)
        summary = data.summary[name]
        assert summary.documents == len(got) and summary.rows == len(dataset)
        assert summary.tokens == sum(len(expected[d]) for d in got)
        assert summary.split == sum(len(expected[d]) > seq_len for d in got)
        assert summary.efficiency == pytest.approx(summary.tokens / (summary.rows * seq_len))
        assert all(
            sum(len(sample[INPUT_IDS]) for sample in dataset[i]) <= seq_len for i in range(len(dataset))
        )
    assert data.summary["train"].efficiency > 0.9


def test_a_batch_is_its_rows_pieces_packed_with_cu_seqlens(tiny_chat_dir, tmp_path):
    data = _module(tiny_chat_dir, tmp_path, batch_size=3, shuffle=False)
    batch = next(iter(data.train_dataloader()))
    pieces = [piece for i in range(3) for piece in data._train[i]]
    lengths = [len(piece[INPUT_IDS]) for piece in pieces]
    assert batch[CU_SEQLENS].tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert batch[INPUT_IDS].tolist() == [[t for piece in pieces for t in piece[INPUT_IDS].tolist()]]
    assert batch[LOSS_MASK].tolist() == [[m for piece in pieces for m in piece[LOSS_MASK].tolist()]]


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_overlong_conversations_are_dropped_or_truncated_and_counted(overlong, tiny_chat_dir, tmp_path):
    seq_len = 40
    data = _module(tiny_chat_dir, tmp_path, seq_len=seq_len, overlong=overlong, val_fraction=0.1)
    records = _records(tiny_chat_dir, "chat.jsonl")
    references = [_reference_chat(data._tokenizer, r["messages"]) for r in records]
    for name, dataset in (("train", data._train), ("val", data._val)):
        kept = {document: (ids, mask) for document, _, ids, mask in _pieces(dataset)}
        for document, (ids, mask) in kept.items():
            reference_ids, reference_mask = references[document]
            assert ids == reference_ids[:seq_len] and mask == reference_mask[:seq_len] and sum(mask) > 0
            if overlong == "drop":
                assert len(reference_ids) <= seq_len
        summary = data.summary[name]
        assert summary.documents == summary.dropped + len(kept)
        assert summary.truncated == sum(len(references[d][0]) > seq_len for d in kept)
    total_long = sum(len(ids) > seq_len for ids, _ in references)
    assert total_long > 0
    dropped = data.summary["train"].dropped + data.summary["val"].dropped
    if overlong == "drop":
        assert dropped == total_long
    else:  # truncated conversations keep at least the first reply here, so none is dropped
        assert dropped == 0 and data.summary["train"].truncated + data.summary["val"].truncated == total_long


def test_validation_split_by_fraction_is_seeded_and_by_file(tiny_chat_dir, tmp_path):
    def documents(dataset):
        return sorted({document for document, *_ in _pieces(dataset)})

    first = _module(tiny_chat_dir, tmp_path, val_fraction=0.1, seed=1)
    again = _module(tiny_chat_dir, tmp_path, val_fraction=0.1, seed=1)
    other = _module(tiny_chat_dir, tmp_path, val_fraction=0.1, seed=2)
    val = documents(first._val)
    assert len(val) == 12 and set(val).isdisjoint(documents(first._train))
    assert documents(again._val) == val and first._train.rows == again._train.rows  # deterministic
    assert documents(other._val) != val and val != list(range(len(val)))  # drawn, not the head

    val_file = tmp_path / "val.jsonl"
    val_file.write_text("\n".join((tiny_chat_dir / "chat.jsonl").read_text().splitlines()[:7]) + "\n")
    by_file = _module(tiny_chat_dir, tmp_path, val_path=str(val_file))
    assert documents(by_file._val) == list(range(7)) and len(documents(by_file._train)) == 120
    val_ids = {document: ids for document, _, ids, _ in _pieces(by_file._val)}
    train_ids = {document: ids for document, _, ids, _ in _pieces(by_file._train)}
    assert all(val_ids[document] == train_ids[document] for document in range(7))  # the file's 7 lines


def test_files_are_tokenized_once_and_read_from_the_cache(tiny_chat_dir, tmp_path, monkeypatch):
    first = _module(tiny_chat_dir, tmp_path)

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again although the cache holds the result")

    monkeypatch.setattr("lightning_cp.data.text.tokenize_conversations", fail)
    second = _module(tiny_chat_dir, tmp_path)
    assert second._train.rows == first._train.rows
    assert second._train.documents.cache_files == first._train.documents.cache_files


def test_another_tokenizer_is_not_served_from_the_cache(tiny_chat_dir, tmp_path):
    first = _module(tiny_chat_dir, tmp_path)
    changed = tmp_path / "changed"
    shutil.copytree(tiny_chat_dir, changed)
    template = changed / "chat_template.jinja"
    template.write_text(template.read_text().replace("'\\n' -}}{%- endfor", "'\\n\\n' -}}{%- endfor"))
    data = TextDataModule(
        str(tiny_chat_dir / "chat.jsonl"), str(changed), format="chat", cache_dir=str(tmp_path / "cache")
    )
    data.prepare_data()
    data.setup("fit")
    assert data._train.documents.cache_files != first._train.documents.cache_files
    document = data._train.rows[0][0].document
    assert len(data._train.documents[document][INPUT_IDS]) > len(first._train.documents[document][INPUT_IDS])


def _text_module(tiny_chat_dir, tmp_path, records: list[dict], **options) -> TextDataModule:
    """A ``format="text"`` module of ``records`` (a file of its own, written once), set up."""
    file = tmp_path / "documents.jsonl"
    if not file.exists():  # rewritten, the file would be another to datasets' cache
        file.write_text("".join(json.dumps(record) + "\n" for record in records))
    options = {
        "seq_len": 64,
        "val_fraction": 1 / len(records),
        "cache_dir": str(tmp_path / "cache"),
        **options,
    }
    data = TextDataModule(str(file), str(tiny_chat_dir), format="text", **options)
    data.prepare_data()
    data.setup("fit")
    return data


def _documents(data: TextDataModule) -> dict[int, list[int]]:
    """Every document's token ids (none is longer than ``seq_len`` here), train and validation together."""
    return {document: ids for split in (data._train, data._val) for document, _, ids, _ in _pieces(split)}


def test_a_document_that_already_ends_with_eos_gets_no_second_one(tiny_chat_dir, tmp_path):
    """The contract of format='text' (lightning_cp.data.tokenization): EOS is appended unless the document's
    last token is one already (its text ends with it, or the tokenizer added it)."""
    eos = "<|im_end|>"
    texts = ["plain words", f"ends with its own{eos}", f"an {eos} inside, then words"]
    data = _text_module(tiny_chat_dir, tmp_path, [{"text": text} for text in texts])
    eos_id = data._tokenizer.eos_token_id
    ids = [data._tokenizer(text)["input_ids"] for text in texts]
    assert ids[1][-1] == eos_id != ids[1][-2] and eos_id in ids[2][:-1]  # the cases are exercised
    assert _documents(data) == {0: [*ids[0], eos_id], 1: ids[1], 2: [*ids[2], eos_id]}


def test_two_columns_of_one_file_are_cached_apart(tiny_chat_dir, tmp_path):
    """The cache key holds the column: another column of the same file is tokenized, not served the first's."""
    records = [{"text": f"document number {i}", "summary": f"short {i}"} for i in range(3)]
    for column in ("text", "summary"):
        data = _text_module(tiny_chat_dir, tmp_path, records, column=column)
        documents = _documents(data)
        decoded = [data._tokenizer.decode(documents[i]) for i in range(3)]
        assert decoded == [record[column] + "<|im_end|>" for record in records], column


class _RowRecorder(_Recorder):
    """Records the first row's token ids of every batch of the data module's training loader."""

    def __init__(self, data: TextDataModule) -> None:
        super().__init__()
        self.data = data

    def training_step(self, batch, batch_idx):
        self.trained.append(batch[INPUT_IDS][0].tolist())
        return self.layer(batch[LOSS_MASK][:, :1]).sum() * 0.0

    def train_dataloader(self):
        return self.data.train_dataloader()


def _train(tiny_chat_dir, tmp_path, directory, max_steps, ckpt_path=None):
    seed_everything(0)
    data = TextDataModule(
        str(tiny_chat_dir / "chat.jsonl"),
        str(tiny_chat_dir),
        format="chat",
        seq_len=64,
        batch_size=2,
        cache_dir=str(tmp_path / "cache"),
    )
    data.prepare_data()
    data.setup("fit")  # a fresh data module, as a resumed run builds it
    module = _RowRecorder(data)
    trainer = quiet_trainer(
        max_steps=max_steps,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=directory, every_n_train_steps=3, save_top_k=-1)],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module.trained


def test_resuming_mid_epoch_trains_the_uninterrupted_batches(tiny_chat_dir, tmp_path):
    uninterrupted = _train(tiny_chat_dir, tmp_path, tmp_path / "once", max_steps=6)
    first = _train(tiny_chat_dir, tmp_path, tmp_path / "twice", max_steps=3)
    resumed = _train(
        tiny_chat_dir, tmp_path, tmp_path / "twice", 6, tmp_path / "twice" / "epoch=0-step=3.ckpt"
    )
    assert len(uninterrupted) == 6 and len(set(map(tuple, uninterrupted))) == 6
    assert first + resumed == uninterrupted


def _tokenizer_with_template(tiny_chat_dir, tmp_path, edit):
    """A copy of the tiny tokenizer and its data whose chat template is ``edit(template)``."""
    directory = tmp_path / "edited"
    shutil.copytree(tiny_chat_dir, directory)
    template = directory / "chat_template.jinja"
    template.write_text(edit(template.read_text()))
    return directory


def _without_generation_blocks(template):
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def test_without_generation_blocks_the_targets_are_still_exactly_the_assistant_tokens(
    tiny_chat_dir, tmp_path
):
    """Llama 3's, Qwen 2.5's and Mistral's templates have no {% generation %} blocks: each assistant turn is
    found from renderings of the conversation's prefixes, up to its end-of-turn token (<|im_end|>, the EOS),
    and equals the spans found in the text (the "\n" the template writes after <|im_end|> is no target)."""
    directory = _tokenizer_with_template(tiny_chat_dir, tmp_path, _without_generation_blocks)
    data = _module(directory, tmp_path)
    assert data.chat_targets == "turns"
    records = _records(directory, "chat.jsonl")
    pieces = [p for dataset in (data._train, data._val) for p in _pieces(dataset)]
    assert sorted(document for document, *_ in pieces) == list(range(len(records)))
    assert max(sum(m["role"] == "assistant" for m in records[d]["messages"]) for d, *_ in pieces) > 1
    for document, start, ids, mask in pieces:
        reference_ids, reference_mask = _reference_chat(data._tokenizer, records[document]["messages"])
        assert start == 0 and ids == reference_ids and mask == reference_mask, f"conversation {document}"


def _drops_earlier_replies(template):
    """A template that renders only the last assistant reply's content (as some drop earlier reasoning)."""
    return _without_generation_blocks(template).replace(
        "message['content'] + '<|im_end|>' -}}{%- else -%}",
        "(message['content'] if loop.last else '...') + '<|im_end|>' -}}{%- else -%}",
    )


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_after_its_own_prompt(
    tiny_chat_dir, tmp_path
):
    """A template that renders earlier replies as '...' (as Qwen3 drops earlier reasoning): every assistant
    turn is a sample of its own, its context exactly the inference prompt (earlier replies as '...'), its
    targets its content and <|im_end|>; a conversation's samples stay on one side of the validation split."""
    directory = _tokenizer_with_template(tiny_chat_dir, tmp_path, _drops_earlier_replies)
    data = _module(directory, tmp_path, val_fraction=0.2)
    tokenizer, records = data._tokenizer, _records(directory, "chat.jsonl")
    sides = {}
    for side, dataset in (("train", data._train), ("val", data._val)):
        owners = list(dataset.documents["conversation"])
        for document, start, ids, mask in _pieces(dataset):
            conversation = owners[document]
            sides.setdefault(conversation, set()).add(side)
            turn = document - owners.index(conversation)  # its samples are consecutive rows, turn by turn
            messages = records[conversation]["messages"]
            i = [k for k, m in enumerate(messages) if m["role"] == "assistant"][turn]
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
            assert turn == 0 or "<|im_start|>assistant\n...<|im_end|>" in prompt
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            assert start == 0 and ids[: len(prompt_ids)] == prompt_ids and sum(mask[: len(prompt_ids)]) == 0
            target = [t for t, m in zip(ids, mask) if m]
            assert tokenizer.decode(target) == messages[i]["content"] + "<|im_end|>", (
                f"conversation {conversation}"
            )
            assert tokenizer.decode(ids[len(prompt_ids) + len(target) :]) == "\n"
        summary = data.summary[side]
        assert summary.documents == len({c for c, s in sides.items() if side in s})
        assert summary.samples == sum(
            sum(m["role"] == "assistant" for m in records[c]["messages"])
            for c, s in sides.items()
            if side in s
        )
    assert sorted(sides) == list(range(len(records))) and all(len(s) == 1 for s in sides.values())
    assert data.summary["train"].samples > data.summary["train"].documents  # multi-turn conversations split


def _no_template_tokenizer(tiny_chat_dir, tmp_path):
    directory = tmp_path / "bare"
    shutil.copytree(tiny_chat_dir, directory)
    (directory / "chat_template.jinja").unlink()
    return directory


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ({"path": "missing.jsonl"}, "path='missing.jsonl' does not exist"),
        ({"path": "model.safetensors", "relative": True}, "has the extension '.safetensors'"),
        ({"format": "markdown"}, "format='markdown' is not supported"),
        ({"overlong": "wrap"}, "overlong='wrap' is not supported"),
        ({"seq_len": 1}, "seq_len=1 must be at least 2"),
        ({"val_fraction": 1.0}, "val_fraction=1.0 must be in (0, 1)"),
        ({"val_fraction": 0.1, "val_path": "chat.jsonl"}, "are both set"),
        ({"tokenizer": "missing"}, "tokenizer='missing' is not a directory"),
        ({"tokenizer": "no_template"}, "has no (default) chat template"),
    ],
)
def test_constructor_mistakes_are_one_line_errors(case, expected, tiny_chat_dir, tmp_path):
    options = {"path": str(tiny_chat_dir / "chat.jsonl"), "tokenizer": str(tiny_chat_dir), "format": "chat"}
    case = dict(case)
    if case.pop("relative", False):
        case["path"] = str(tiny_chat_dir / case["path"])
    if case.get("val_path"):
        case["val_path"] = str(tiny_chat_dir / case["val_path"])
    if case.get("tokenizer") == "no_template":
        case["tokenizer"] = str(_no_template_tokenizer(tiny_chat_dir, tmp_path))
    with pytest.raises(ValueError) as error:
        TextDataModule(**{**options, **case})
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_missing_column_is_named_in_the_constructor_or_at_prepare_data(tiny_chat_dir, tmp_path):
    """A JSON-lines file's first record is read where the data module is built; a parquet file's columns
    only when ``datasets`` reads it, at ``prepare_data``."""
    with pytest.raises(ValueError, match=r"text.jsonl' line 1 has no 'messages' \(its keys: \['text'\]\)"):
        TextDataModule(str(tiny_chat_dir / "text.jsonl"), str(tiny_chat_dir), format="chat")
    datasets = pytest.importorskip("datasets")
    parquet = tmp_path / "text.parquet"
    datasets.Dataset.from_list(_records(tiny_chat_dir, "text.jsonl")).to_parquet(str(parquet))
    data = TextDataModule(str(parquet), str(tiny_chat_dir), format="chat", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"has no column 'messages' \(its columns: \['text'\]\)"):
        data.prepare_data()


def _chat_file(path, conversations):
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return path


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_a_prompt_longer_than_seq_len_is_dropped_and_counted_never_trained_without_targets(
    overlong, tiny_chat_dir, tmp_path
):
    """A conversation whose prompt alone fills ``seq_len`` has no target in its first ``seq_len`` tokens: it
    is dropped and counted under either ``overlong`` (never served as a row without targets); one whose first
    reply starts inside ``seq_len`` is cut there under ``truncate`` and counted as truncated."""
    seq_len = 32
    question = {"role": "user", "content": "What is the capital of Peru?"}
    answer = {"role": "assistant", "content": "The capital of Peru is Lima."}
    long_prompt = [{"role": "system", "content": " ".join(["Answer briefly."] * 12)}, question, answer]
    long_reply = [question, {"role": "assistant", "content": " ".join(["red green blue"] * 8)}]
    conversations = [[question, answer]] * 3 + [long_prompt, long_reply]
    train = _chat_file(tmp_path / "chat_train.jsonl", conversations)
    val = _chat_file(tmp_path / "chat_val.jsonl", [[question, answer]])
    data = TextDataModule(
        str(train),
        str(tiny_chat_dir),
        format="chat",
        seq_len=seq_len,
        overlong=overlong,
        val_path=str(val),
        cache_dir=str(tmp_path / "cache"),
    )
    data.prepare_data()
    data.setup("fit")
    references = [_reference_chat(data._tokenizer, messages) for messages in conversations]
    first_target = [mask.index(1) for _, mask in references]
    assert first_target[3] >= seq_len and first_target[4] < seq_len < len(references[4][0])  # the cases hold
    kept = {document: (ids, mask) for document, _, ids, mask in _pieces(data._train)}
    assert sorted(kept) == ([0, 1, 2, 4] if overlong == "truncate" else [0, 1, 2])
    for document, (ids, mask) in kept.items():
        reference_ids, reference_mask = references[document]
        assert ids == reference_ids[:seq_len] and mask == reference_mask[:seq_len] and sum(mask) > 0
    summary = data.summary["train"]
    assert summary.documents == 5
    assert (summary.dropped, summary.truncated) == ((1, 1) if overlong == "truncate" else (2, 0))


_QUESTION = {"role": "user", "content": "What is 2 plus 2?"}
_GOOD = (
    json.dumps({"messages": [_QUESTION, {"role": "assistant", "content": "2 plus 2 is 4."}]}).encode() + b"\n"
)


@pytest.mark.parametrize(
    ("content", "when", "expected"),
    [
        (b"", "built", r"holds no record \(it is empty\); pass a file with at least one"),
        (b"\n  \n", "built", r"holds no record \(it is empty\)"),
        (
            b"messages: [hi]\n",
            "built",
            r"line 1 is not JSON \(Expecting value, at column 1\); write one JSON",
        ),
        (_GOOD + b"[1, 2]\n", "prepared", r"line 2 is a JSON list, not an object; write one object per"),
        (
            b'{"messages": "hi"}\n',
            "built",
            r"line 1: the conversation is a str, not a list of messages; write",
        ),
        (_GOOD + b"\n" + _GOOD[:-3] + b"\n", "prepared", r"line 3 is not JSON \(Expecting ',' delimiter"),
        (
            _GOOD + _GOOD.replace(b"2 plus 2 is 4", b"caf\xe9"),
            "prepared",
            rf"line 2: byte {_GOOD.index(b'2 plus 2 is 4') + 4} of the line \(b'\\xe9'\) is not UTF-8; re-encode the file as UTF-8",
        ),
        (
            _GOOD + b'{"messages": [{"from": "bing", "value": "hi"}]}\n',
            "prepared",
            r"line 2: message 0 is from 'bing', which is not a ShareGPT sender .*; rename it",
        ),
        (
            _GOOD + b'{"messages": [{"role": "user"}]}\n',
            "prepared",
            r"line 2: the chat template fails on it \(UndefinedError: .*\); check the messages' keys",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}\n' * 2,
            "prepared",
            r"none of its 2 conversations has an assistant reply to train on \(line 1 has the roles \['user', "
            + r"'bot'\]\); format='chat' trains on the messages of role 'assistant' \(ShareGPT: from 'gpt'\)",
        ),
    ],
)
def test_a_bad_chat_file_fails_before_training_in_one_line_naming_the_file_the_line_and_the_fix(
    content, when, expected, tiny_chat_dir, tmp_path
):
    """An empty file, a line that is not JSON (or not an object), a byte that is not UTF-8, a sender or
    a message the template cannot render, a file without any assistant reply: one line naming the file and
    the line, in the constructor where the first record shows it, else at ``prepare_data``."""
    file = tmp_path / "chat.jsonl"
    file.write_bytes(content)
    with pytest.raises(ValueError) as error:
        data = TextDataModule(str(file), str(tiny_chat_dir), format="chat", cache_dir=str(tmp_path / "cache"))
        assert when == "prepared", "the constructor accepted the file"
        data.prepare_data()
    message = str(error.value)
    assert message.startswith(f"path={str(file)!r}") and "\n" not in message
    assert re.search(expected, message), message


def test_sharegpt_conversations_train_as_their_role_and_content_messages(tiny_chat_dir, tmp_path):
    """ShareGPT's ``{"from": "human" | "gpt" | "system", "value"}`` messages give exactly the tokens and
    targets of the same conversations written as user / assistant / system messages."""
    sender = {"user": "human", "assistant": "gpt", "system": "system"}
    records = _records(tiny_chat_dir, "chat.jsonl")[:20]
    file = tmp_path / "sharegpt.jsonl"
    file.write_text(
        "".join(
            json.dumps(
                {"conversations": [{"from": sender[m["role"]], "value": m["content"]} for m in r["messages"]]}
            )
            + "\n"
            for r in records
        )
    )
    data = TextDataModule(
        str(file),
        str(tiny_chat_dir),
        format="chat",
        column="conversations",
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    data.prepare_data()
    data.setup("fit")
    pieces = [p for dataset in (data._train, data._val) for p in _pieces(dataset)]
    assert sorted(document for document, *_ in pieces) == list(range(len(records)))
    assert any(records[document]["messages"][0]["role"] == "system" for document, *_ in pieces)
    for document, _, ids, mask in pieces:
        assert (ids, mask) == _reference_chat(data._tokenizer, records[document]["messages"])


def test_chat_template_kwargs_reach_every_rendering_and_the_cache_key(stock_chat_dir, tmp_path):
    """Qwen3.5's small models' template opens an empty <think> block unless enable_thinking is set: the
    same file trains after either prompt (each tokenization cached under its own key); reasoning data is
    refused without the option, naming the line and the option."""
    directory = stock_chat_dir("qwen3_5_nothink")
    question = {"role": "user", "content": "What is 2 plus 2?"}

    def target(file, **kwargs):
        data = TextDataModule(
            str(file),
            str(directory),
            format="chat",
            seq_len=64,
            val_path=str(file),
            cache_dir=str(tmp_path / "cache"),
            **kwargs,
        )
        data.prepare_data()
        data.setup("fit")
        [(_, _, ids, mask), *_] = _pieces(data._train)
        return data._tokenizer.decode([t for t, m in zip(ids, mask) if m])

    plain = _chat_file(tmp_path / "chat.jsonl", [[question, {"role": "assistant", "content": "4."}]] * 2)
    assert target(plain) == "4.<|im_end|>"
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    assert target(plain, **thinking) == "\n</think>\n\n4.<|im_end|>"
    reasoned = [[question, {"role": "assistant", "reasoning_content": "Add them.", "content": "4."}]] * 2
    reasoned = _chat_file(tmp_path / "chat_reasoned.jsonl", reasoned)
    with pytest.raises(
        ValueError, match=r"line 1: the chat template's generation prompt .* enable_thinking: true"
    ):
        target(reasoned)
    assert target(reasoned, **thinking) == "Add them.\n</think>\n\n4.<|im_end|>"


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_a_later_turn_whose_prompt_fills_seq_len_is_dropped_and_counted_alone(
    overlong, tiny_chat_dir, tmp_path
):
    """With a sample per turn (a template that rewrites earlier turns), a turn whose own prompt fills
    ``seq_len`` is dropped and counted; the conversation's earlier turn still trains."""
    directory = _tokenizer_with_template(tiny_chat_dir, tmp_path, _drops_earlier_replies)
    question = {"role": "user", "content": "What is the capital of Peru?"}
    answer = {"role": "assistant", "content": "The capital of Peru is Lima."}
    long_question = {"role": "user", "content": " ".join(["Reverse the words: red green blue"] * 6)}
    conversations = [[question, answer, long_question, answer], [question, answer]]
    data = TextDataModule(
        str(_chat_file(tmp_path / "chat_train.jsonl", conversations)),
        str(directory),
        format="chat",
        seq_len=48,
        overlong=overlong,
        val_path=str(_chat_file(tmp_path / "chat_val.jsonl", [[question, answer]])),
        cache_dir=str(tmp_path / "cache"),
    )
    data.prepare_data()
    data.setup("fit")
    prompt = data._tokenizer.apply_chat_template(conversations[0][:3], add_generation_prompt=True)[
        "input_ids"
    ]
    assert len(prompt) >= 48  # the case holds
    owners = list(data._train.documents["conversation"])
    kept = [(owners[document], ids, mask) for document, _, ids, mask in _pieces(data._train)]
    assert sorted(owner for owner, *_ in kept) == [0, 1] and all(sum(mask) > 0 for *_, mask in kept)
    summary = data.summary["train"]
    assert (summary.documents, summary.samples, summary.dropped, summary.truncated) == (2, 3, 1, 0)
