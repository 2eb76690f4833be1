"""``lightning_cp.rollout_logprob_format``: the parts a writer commits are read back entry by entry, in rank
order, with the part and line of each; a part still being written (or abandoned) is never read; a damaged line
is refused with its part, its line and the fix. The end-to-end path (predict -> files -> RolloutDataModule) is
tests/callbacks/test_rollout_logprob_writer.py's."""

from __future__ import annotations

import json

import pytest

from lightning_cp.rollout_logprob_format import (
    LogprobEntry,
    LogprobPartWriter,
    check_logprob_dir,
    part_path,
    read_entries,
)

ENTRIES = [
    LogprobEntry(2, [5, 6, 7], [-0.5, -1.25]),
    LogprobEntry(0, [1, 2], [-2.0]),
    LogprobEntry(1, [3, 4, 5, 6], [-0.125, -3.0, -0.0]),
]


def test_committed_parts_are_read_back_in_rank_order_with_their_lines(tmp_path):
    directory = tmp_path / "predictions"
    writers = [LogprobPartWriter(directory, rank) for rank in (1, 0)]  # the directory is created
    writers[0].write(ENTRIES[2])
    writers[1].write(ENTRIES[0])
    writers[1].write(ENTRIES[1])
    with pytest.raises(ValueError, match=r"ref_logprobs='.*' is not a directory with logprobs.dp\*.jsonl"):
        check_logprob_dir("ref_logprobs", str(directory))  # nothing committed: only .partial files
    for writer in writers:
        writer.commit()
    assert [p.name for p in check_logprob_dir("x", str(directory))] == [
        "logprobs.dp0.jsonl",
        "logprobs.dp1.jsonl",
    ]
    assert part_path(directory, 1) == directory / "logprobs.dp1.jsonl" == writers[0].path
    assert json.loads(part_path(directory, 1).read_text()) == {
        "rollout": 1,
        "tokens": [3, 4, 5, 6],
        "logprobs": [-0.125, -3.0, -0.0],
    }
    read = list(read_entries("ref_logprobs", str(directory)))
    assert [entry for _, entry in read] == ENTRIES
    assert [where.split(": ")[1] for where, _ in read] == [
        "logprobs.dp0.jsonl line 1",
        "logprobs.dp0.jsonl line 2",
        "logprobs.dp1.jsonl line 1",
    ]


def test_an_abandoned_part_is_left_unnamed_and_unread(tmp_path):
    committed, abandoned = LogprobPartWriter(tmp_path, 0), LogprobPartWriter(tmp_path, 1)
    committed.write(ENTRIES[0])
    abandoned.write(ENTRIES[1])
    committed.commit()
    abandoned.abandon()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logprobs.dp0.jsonl", "logprobs.dp1.jsonl.partial"]
    assert [entry for _, entry in read_entries("old_logprobs", str(tmp_path))] == [ENTRIES[0]]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"rollout": 0, "tokens": [1, 2]',
            r"line 3 is not JSON \(.*\); the file is damaged: run predict again",
        ),
        (
            '{"rollout": "0", "tokens": [1, 2], "logprobs": [-1.0]}',
            r"line 3 is not a rollout's entry \{\"rollout\"",
        ),
        (
            "[0, [1, 2], [-1.0]]",
            r"line 3 is not a rollout's entry .* pass a directory lightning-cp predict wrote",
        ),
    ],
    ids=["not JSON", "a string index", "not an object"],
)
def test_a_damaged_line_is_refused_with_its_part_and_line(tmp_path, line, message):
    good = json.dumps(ENTRIES[0]._asdict())
    part_path(tmp_path, 0).write_text(f"{good}\n\n{line}\n")  # the blank line is skipped, but counted
    with pytest.raises(ValueError, match=rf"ref_logprobs='.*': logprobs.dp0.jsonl {message}") as error:
        list(read_entries("ref_logprobs", str(tmp_path)))
    assert "\n" not in str(error.value)
