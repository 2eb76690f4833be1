"""``RolloutDataModule``: each completion's tokens are the targets and carry their rollout's advantage and
their own log-probabilities (ids and chat text), GRPO's advantages against numpy per group, packed and
padded batches of whole rollouts, the log-prob directories read back, and every refusal naming its line."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule

from lightning_cp.constants import (
    ADVANTAGES,
    CU_SEQLENS,
    INPUT_IDS,
    LOSS_MASK,
    OLD_LOGPROBS,
    REF_LOGPROBS,
    ROLLOUT_INDEX,
)
from lightning_cp.data import RolloutDataModule
from lightning_cp.data.rollout_samples import PADDING
from tests._trainer import cp_trainer

pytest.importorskip("datasets")


def _write(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _id_rollouts(grouped: bool) -> list[dict]:
    """Three prompts (four completions of the first, three of the others) of unequal lengths, distinct rewards
    within each group, and a distinct old log-prob per completion token."""
    records = []
    for prompt in range(3):
        for k in range(4 if prompt == 0 else 3):
            index = len(records)
            completion = [10 + (index + j) % 40 for j in range(2 + (index * 5) % 7)]
            record = {
                "prompt_ids": [1 + prompt, 2, 3 + prompt][: 2 + prompt % 2],
                "completion_ids": completion,
                "reward": float((k * 7 + prompt) % 5) + 0.25 * k,
                "old_logprobs": [-(index + 1) / 10 - j / 1000 for j in range(len(completion))],
            }
            if grouped:
                record["group"] = f"question-{prompt}"
                record["prompt_ids"] = [5, 6, 7, 8][: 1 + (index % 4)]  # prompts differ within a group
            records.append(record)
    return records


def _module(path, tmp_path, **options) -> RolloutDataModule:
    data = RolloutDataModule(str(path), cache_dir=str(tmp_path / "cache"), **options)
    data.prepare_data()
    data.setup("fit")
    return data


def _expected_advantages(records, normalize):
    """Per group, by numpy: ``(r - mean) / (std + 1e-4)`` (unbiased std) or ``r - mean``."""
    keys = [r.get("group", tuple(r["prompt_ids"])) for r in records]
    rewards = np.array([r["reward"] for r in records])
    out = np.empty(len(records))
    for key in set(keys):
        members = [i for i, k in enumerate(keys) if k == key]
        group = rewards[members]
        centered = group - group.mean()
        out[members] = centered if normalize == "mean" else centered / (np.std(group, ddof=1) + 1e-4)
    return out


def _rollouts_of(batch):
    """``{rollout index: {key: values of its tokens}}`` of a collated batch, checking each rollout is one
    contiguous run (in packed batches: exactly one document)."""
    rollout = batch[ROLLOUT_INDEX]
    found = {}
    if CU_SEQLENS in batch:
        cu = batch[CU_SEQLENS].tolist()
        spans = [(0, slice(a, b)) for a, b in itertools.pairwise(cu)]
    else:
        spans = [(row, slice(0, int(batch["input_mask"][row].sum()))) for row in range(rollout.shape[0])]
    for row, span in spans:
        indices = rollout[row, span].unique().tolist()
        assert len(indices) == 1, f"a document holds the tokens of rollouts {indices}"
        assert indices[0] not in found, f"rollout {indices[0]} is split"
        found[indices[0]] = {key: value[row, span] for key, value in batch.items() if key != CU_SEQLENS}
    if "input_mask" in batch:
        assert (rollout[~batch["input_mask"]] == 0).all() and (
            batch[LOSS_MASK][~batch["input_mask"]] == 0
        ).all()
    return found


@pytest.mark.parametrize(
    ("packed", "normalize", "grouped"), [(True, "std", False), (False, "std", True), (True, "mean", True)]
)
def test_completion_tokens_are_the_targets_and_carry_their_values(tmp_path, packed, normalize, grouped):
    records = _id_rollouts(grouped)
    path = _write(tmp_path / "rollouts.jsonl", records)
    data = _module(path, tmp_path, seq_len=24, packed=packed, normalize=normalize, batch_size=2)
    advantages = _expected_advantages(records, normalize)
    seen = {}
    for batch in data.train_dataloader():
        if packed:
            assert batch[INPUT_IDS].shape[1] <= 2 * 24
        seen.update(_rollouts_of(batch))
    assert sorted(seen) == list(range(len(records)))
    for index, values in seen.items():
        record = records[index]
        prompt, completion = record["prompt_ids"], record["completion_ids"]
        target = values[LOSS_MASK] == 1
        assert values[INPUT_IDS].tolist() == prompt + completion
        assert values[INPUT_IDS][target].tolist() == completion
        assert target.tolist() == [False] * len(prompt) + [True] * len(completion)
        assert (values[ROLLOUT_INDEX] == index).all()
        assert values[ADVANTAGES].dtype == values[OLD_LOGPROBS].dtype == torch.float32
        assert (values[ADVANTAGES] != 0).tolist() == target.tolist()  # rewards differ within every group
        torch.testing.assert_close(
            values[ADVANTAGES][target], torch.full((len(completion),), advantages[index], dtype=torch.float32)
        )
        expected = torch.tensor(record["old_logprobs"], dtype=torch.float32)
        assert (
            torch.equal(values[OLD_LOGPROBS][target], expected) and (values[OLD_LOGPROBS][~target] == 0).all()
        )
        assert REF_LOGPROBS not in values


def test_advantages_given_are_used_as_they_are_and_predict_serves_the_file_in_order(tmp_path):
    records = [
        {"prompt_ids": [1, 2], "completion_ids": [3] * (1 + i), "advantage": i - 1.5} for i in range(5)
    ]
    data = _module(_write(tmp_path / "r.jsonl", records), tmp_path, seq_len=8, packed=False, batch_size=2)
    batches = list(data.predict_dataloader())
    assert [b[ROLLOUT_INDEX][:, 0].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    for batch in batches:
        for row in range(len(batch[INPUT_IDS])):
            index = int(batch[ROLLOUT_INDEX][row, 0])
            assert batch[ADVANTAGES][row][batch[LOSS_MASK][row] == 1].eq(index - 1.5).all()
    assert data.val_dataloader() == [] and data.vocab_size is None


def test_chat_completions_decode_to_their_text_and_end_of_turn(tiny_chat_dir, tmp_path):
    prompts = [
        [{"role": "user", "content": "What is 2 + 3?"}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of Peru?"}],
    ]
    completions = [["5", "It is 5."], ["Lima", "Lima, the capital."]]
    records = [
        {"prompt": prompt, "completion": text, "reward": float(k)}
        for prompt, texts in zip(prompts, completions)
        for k, text in enumerate(texts)
    ]
    path = _write(tmp_path / "chat_rollouts.jsonl", records)
    data = _module(path, tmp_path, tokenizer=str(tiny_chat_dir), seq_len=64)
    tokenizer = data._tokenizer
    assert data.vocab_size == len(tokenizer)
    seen = {}
    for batch in data.train_dataloader():
        seen.update(_rollouts_of(batch))
    for index, values in seen.items():
        record = records[index]
        target = values[LOSS_MASK] == 1
        prompt_text = tokenizer.apply_chat_template(
            record["prompt"], tokenize=False, add_generation_prompt=True
        )
        assert tokenizer.decode(values[INPUT_IDS][~target]) == prompt_text
        assert tokenizer.decode(values[INPUT_IDS][target]) == record["completion"] + "<|im_end|>"
        assert target[-1] and target.sum() > 1  # the completion ends the sample
        assert torch.equal(values[ADVANTAGES] != 0, target)


def _records_with(line3: dict | None = None, **first) -> list[dict]:
    """Two groups of two rollouts; ``first`` updates the first record, ``line3`` replaces the third."""
    records = [
        {
            "prompt_ids": [1, 2],
            "completion_ids": [3, 4, 5],
            "reward": 1.0,
            "old_logprobs": [-1.0, -0.5, -0.25],
        },
        {"prompt_ids": [1, 2], "completion_ids": [6, 7], "reward": 0.0, "old_logprobs": [-2.0, -0.5]},
        {"prompt_ids": [9], "completion_ids": [3, 4], "reward": 0.5, "old_logprobs": [-1.0, -0.5]},
        {"prompt_ids": [9], "completion_ids": [8], "reward": 1.5, "old_logprobs": [-0.1]},
    ]
    records[0].update(first)
    if line3 is not None:
        records[2] = line3
    return records


_GOOD = _records_with()[2]
REFUSALS = {
    # name: (records, constructor options, where it is refused, message)
    "logprob length": (
        _records_with({**_GOOD, "old_logprobs": [-1.0]}),
        {},
        "setup",
        r"line 3: old_logprobs: 1 log-probabilities for a completion of 2 tokens; write one per completion token",
    ),
    "logprob length (first)": (
        _records_with(old_logprobs=[-1.0, -1.0]),
        {},
        "built",
        r"line 1: old_logprobs: 2 log-probabilities for a completion of 3 tokens",
    ),
    "nan logprob": (
        _records_with({**_GOOD, "old_logprobs": [-1.0, float("nan")]}),
        {},
        "setup",
        (
            r"line 3: old_logprobs: completion token 1 has the log-probability nan, which is not finite or above 0; "
            r"write log p\(token\)"
        ),
    ),
    "positive logprob": (
        _records_with({**_GOOD, "old_logprobs": [0.01, -1.0]}),
        {},
        "setup",
        r"line 3: old_logprobs: completion token 0 has the log-probability 0.01",
    ),
    "logprobs on some rollouts": (
        _records_with({key: value for key, value in _GOOD.items() if key != "old_logprobs"}),
        {},
        "setup",
        r"line 3: it has no 'old_logprobs', which other rollouts of the file have; give every rollout its",
    ),
    "empty completion": (
        _records_with({**_GOOD, "completion_ids": [], "old_logprobs": []}),
        {},
        "setup",
        r"line 3: completion_ids is empty; a rollout needs at least one prompt and one completion token",
    ),
    "empty prompt": (
        _records_with(prompt_ids=[]),
        {},
        "built",
        r"line 1: prompt_ids is empty",
    ),
    "longer than seq_len": (
        _records_with({**_GOOD, "completion_ids": [3] * 9, "old_logprobs": [-1.0] * 9}),
        {},
        "setup",
        (
            r"line 3 is a rollout of 10 tokens, longer than seq_len=8; a rollout is never cut .* set seq_len to at "
            r"least 10"
        ),
    ),
    "group of one": (
        _records_with(prompt_ids=[1, 2, 3]),
        {},
        "setup",
        (
            r"line 1 is the only rollout of its prompt: its GRPO advantage .* is undefined; sample at least two "
            r"completions per prompt"
        ),
    ),
    "named group of one": (
        [{**r, "group": g} for r, g in zip(_records_with(), ["a", "a", "b", "c"])],
        {},
        "setup",
        r"line 3 is the only rollout of group \"b\"",
    ),
    "nan reward": (
        _records_with({**_GOOD, "reward": float("nan")}),
        {},
        "setup",
        r"line 3: its reward is nan; write a finite number",
    ),
    "missing column": (
        _records_with({"prompt_ids": [9], "reward": 0.5}),
        {},
        "setup",
        r"line 3: it has no 'completion_ids' \(its keys: \['prompt_ids', 'reward'\]\); give every rollout",
    ),
    "float ids": (
        _records_with({**_GOOD, "completion_ids": [3, 4.5]}),
        {},
        "setup",
        r"line 3: completion_ids holds 4.5 \(a float\), not a token id; write the token ids as JSON integers",
    ),
    "string ids (first)": (
        _records_with(prompt_ids=["a"]),
        {},
        "built",
        r"line 1: prompt_ids holds the string 'a', not a token id",
    ),
    "reward and advantage": (
        _records_with({**_GOOD, "advantage": 1.0}),
        {},
        "setup",
        r"line 3: it has both of 'reward' and 'advantage'; give each rollout one",
    ),
    "neither reward nor advantage (first)": (
        _records_with(reward=None),
        {},
        "built",
        r"line 1: it has neither of 'reward' and 'advantage'",
    ),
    "rewards and advantages mixed": (
        _records_with({**{k: v for k, v in _GOOD.items() if k != "reward"}, "advantage": 1.0}),
        {},
        "setup",
        r"line 3 gives an advantage but line 1 a reward; give every rollout of a file a reward",
    ),
    "both forms": (
        _records_with(prompt=[{"role": "user", "content": "hi"}]),
        {},
        "built",
        r"has both of prompt_ids / completion_ids .* and prompt / completion",
    ),
    "text without a tokenizer": (
        [{"prompt": [{"role": "user", "content": "hi"}], "completion": "yo", "reward": 1.0}],
        {},
        "built",
        r"holds text rollouts \(prompt / completion\), which need a tokenizer with a chat template; pass tokenizer",
    ),
    "column and directory": (
        _records_with(),
        {"old_logprobs": "DIR"},
        "built",
        r"old_logprobs='.*' and the column 'old_logprobs' of path=.* both give the rollouts' old_logprobs; drop",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_rollouts_are_refused_with_the_line_and_the_fix(tmp_path, case):
    records, options, where, message = REFUSALS[case]
    path = _write(tmp_path / "bad.jsonl", records)
    if options.get("old_logprobs") == "DIR":
        _write_logprob_dir(tmp_path / "dir", records)
        options = {"old_logprobs": str(tmp_path / "dir")}
    with pytest.raises(ValueError, match=message) as error:
        data = RolloutDataModule(str(path), seq_len=8, cache_dir=str(tmp_path / "cache"), **options)
        assert where == "setup", f"{case}: not refused when built"
        data.setup("fit")
    assert "\n" not in str(error.value)


def _write_logprob_dir(directory, records, parts=((0, 2), (2, None)), logprob="old_logprobs"):
    """The layout ``RolloutLogprobWriter`` writes, by hand: one part per slice of ``parts``."""
    directory.mkdir()
    for rank, (start, stop) in enumerate(parts):
        lines = [
            {"rollout": i, "tokens": r["prompt_ids"] + r["completion_ids"], "logprobs": r[logprob]}
            for i, r in enumerate(records)
        ][start:stop]
        _write(directory / f"logprobs.dp{rank}.jsonl", lines)
    return directory


def test_a_logprob_directory_puts_each_value_on_its_token(tmp_path):
    records = _records_with()
    reference = [{**r, "ref": [v - 1 for v in r["old_logprobs"]]} for r in records]
    directory = _write_logprob_dir(tmp_path / "ref", reference, logprob="ref")
    path = _write(tmp_path / "r.jsonl", records)
    data = _module(path, tmp_path, seq_len=8, ref_logprobs=str(directory), packed=False, batch_size=4)
    [batch] = list(data.predict_dataloader())
    for row, record in enumerate(reference):
        target = batch[LOSS_MASK][row] == 1
        assert torch.equal(batch[REF_LOGPROBS][row][target], torch.tensor(record["ref"]))
        assert torch.equal(batch[OLD_LOGPROBS][row][target], torch.tensor(record["old_logprobs"]))
        assert (batch[REF_LOGPROBS][row][~target] == 0).all()


def _stale(records):
    other = [dict(r) for r in records]
    other[1]["prompt_ids"] = [1, 3]
    return other


DIRECTORY_REFUSALS = {
    "a part missing": (
        lambda d, r: _write_logprob_dir(d, r, parts=((0, 2),)),
        (
            r"ref_logprobs='.*' has no log-probabilities for 2 of the 4 rollouts of path=.* \(the first: rollout 2\); "
            r"a data-parallel rank's part is missing"
        ),
    ),
    "another file": (
        lambda d, r: _write_logprob_dir(d, _stale(r)),
        (
            r"logprobs.dp0.jsonl line 2: rollout 1 was predicted on other tokens .* another file, tokenizer or chat "
            r"template; run lightning-cp predict again"
        ),
    ),
    "a length mismatch": (
        lambda d, r: _write_logprob_dir(d, [{**x, "old_logprobs": x["old_logprobs"][:-1]} for x in r]),
        r"logprobs.dp0.jsonl line 1: rollout 0: 2 log-probabilities for a completion of 3 tokens",
    ),
    "a rollout twice": (
        lambda d, r: _write_logprob_dir(d, r, parts=((0, 3), (2, None))),
        r"logprobs.dp1.jsonl line 1 writes rollout 2 a second time",
    ),
    "more rollouts": (
        lambda d, r: _write_logprob_dir(d, [*r, r[0]]),
        (
            r"logprobs.dp1.jsonl line 3 is rollout 4, but path=.* has 4 rollouts: the directory was written for "
            r"another file"
        ),
    ),
    "no parts": (
        lambda d, r: d.mkdir(),
        r"ref_logprobs='.*' is not a directory with logprobs.dp\*.jsonl files; run lightning-cp predict",
    ),
}


@pytest.mark.parametrize("case", list(DIRECTORY_REFUSALS))
def test_a_logprob_directory_of_other_rollouts_is_refused(tmp_path, case):
    write, message = DIRECTORY_REFUSALS[case]
    records = _records_with()
    write(tmp_path / "ref", records)
    path = _write(
        tmp_path / "r.jsonl", [{k: v for k, v in r.items() if k != "old_logprobs"} for r in records]
    )
    with pytest.raises(ValueError, match=message):
        _module(path, tmp_path, seq_len=8, ref_logprobs=str(tmp_path / "ref"))


def test_the_advantages_are_grpo_s_over_the_whole_file_not_a_row(tmp_path):
    # Rollouts of one prompt in different packed rows (seq_len 8 holds two of them): the advantages still
    # compare each reward with all four, as numpy does on the whole file.
    records = [{"prompt_ids": [1, 2], "completion_ids": [3, 4], "reward": r} for r in (0.0, 1.0, 3.0, 7.0)]
    data = _module(_write(tmp_path / "r.jsonl", records), tmp_path, seq_len=8, batch_size=1, shuffle=False)
    rows = [batch for batch in data.train_dataloader()]
    assert len(rows) == 2
    expected = _expected_advantages(records, "std")
    for batch in rows:
        for index, values in _rollouts_of(batch).items():
            assert values[ADVANTAGES][-1].item() == pytest.approx(expected[index], rel=1e-6)


def _trained(batch) -> list[int]:
    """The rollouts whose targets a batch holds (padding rows of a padded batch have none)."""
    return batch[ROLLOUT_INDEX][batch[LOSS_MASK] > 0].unique().tolist()


def _rank_batches(
    data: RolloutDataModule, dp: int, epoch: int, training: bool
) -> tuple[list[list[dict]], list]:
    """Every data-parallel rank's batches of one epoch, as the strategy's ``distributed_sampler_kwargs``
    make the loaders, and the epoch's order of the rows (the permutation of the sampler's seed)."""
    out = []
    for rank in range(dp):
        data.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank})
        loader = data.train_dataloader() if training else data.val_dataloader()
        loader.sampler.set_epoch(epoch)
        out.append(list(loader))
    data.trainer = None
    rows = len(loader.dataset)
    seeded = torch.Generator().manual_seed(loader.sampler.seed + epoch)
    return out, torch.randperm(rows, generator=seeded).tolist() if training else list(range(rows))


@pytest.mark.parametrize(("packed", "dp"), [(False, 2), (True, 3)], ids=["padded-dp2", "packed-dp3"])
def test_every_rollout_trains_once_per_epoch_whatever_dp(tmp_path, packed, dp):
    """Where Lightning's DistributedSampler would repeat rows to even the ranks out, a short rank gets a
    batch without targets or inputs: step k is the k-th chunk of batch_size * dp rows of the epoch's order
    (the unsharded global batch), each rollout once per epoch, in training and in validation."""
    path = _write(tmp_path / "r.jsonl", _id_rollouts(False)[:9])
    data = _module(path, tmp_path, seq_len=12, packed=packed, batch_size=2, val_path=str(path))
    rows = data._train.rows or [[i] for i in range(9)]
    assert len(rows) % dp != 0  # Lightning's sampler would repeat rows
    padding_only = 0
    for epoch, training in ((0, True), (1, True), (0, False)):
        ranks, order = _rank_batches(data, dp, epoch, training)
        assert len({len(batches) for batches in ranks}) == 1  # every rank runs every step
        for step, batches in enumerate(zip(*ranks, strict=True)):
            chunk = order[step * 2 * dp : (step + 1) * 2 * dp]
            expected = sorted(rollout for position in chunk for rollout in rows[position])
            assert sorted(r for batch in batches for r in _trained(batch)) == expected, (epoch, step)
            for batch in batches:
                if not _trained(batch):
                    padding_only += 1
                    assert not batch["input_mask"].any() and (batch[ROLLOUT_INDEX] == PADDING).all()
                    assert batch[ADVANTAGES].eq(0).all() and batch[OLD_LOGPROBS].eq(0).all()
    assert padding_only > 0


class _RolloutRecorder(LightningModule):
    """Records the rollouts whose targets each training step holds (the weights never change)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.steps: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.steps.append(_trained(batch))
        return self.layer(batch[LOSS_MASK][:, :1]).sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _steps_at_dp2(path: str, cache_dir: str) -> list[list[int]]:
    module = _RolloutRecorder()
    data = RolloutDataModule(path, cache_dir=cache_dir, seq_len=12, packed=False, batch_size=2)
    cp_trainer(1, max_epochs=1).fit(module, datamodule=data)
    return module.steps


def test_the_trainer_keeps_the_sampler_and_trains_each_rollout_once(world2, tmp_path):
    """Through Lightning at dp=2 (which replaces any sampler that is no DistributedSampler): 9 rollouts in
    batches of 2 are 3 steps on both ranks, the last one's second rank without targets."""
    path = _write(tmp_path / "r.jsonl", _id_rollouts(False)[:9])
    ranks = world2.run(_steps_at_dp2, str(path), str(tmp_path / "cache"))
    assert [len(steps) for steps in ranks] == [3, 3] and ranks[1][2] == []
    assert sorted(r for steps in ranks for step in steps for r in step) == list(range(9))
