import pytest
import torch

from lightning_cp.data import collate_packed, collate_padded


def _samples():
    lengths = [3, 5, 1]
    samples = []
    for i, n in enumerate(lengths):
        samples.append(
            {
                "input_ids": torch.arange(10 * i + 1, 10 * i + 1 + n, dtype=torch.int32),
                "loss_mask": torch.tensor([0.0] + [1.0] * (n - 1)),
                "labels": torch.arange(n) + 100 * (i + 1),
                "position_ids": torch.arange(n),
            }
        )
    return samples


def test_padded_rows_match_samples_and_padding_is_never_a_target():
    samples = _samples()
    batch = collate_padded(samples, pad_id=7)
    assert set(batch) == {"input_ids", "loss_mask", "labels", "position_ids", "input_mask"}
    for key in batch:
        assert batch[key].shape == (3, 5), key
    assert batch["input_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    pad_values = {"input_ids": 7, "loss_mask": 0, "labels": -100, "position_ids": 0}
    for key, pad in pad_values.items():
        for row, sample in enumerate(samples):
            n = sample["input_ids"].numel()
            assert batch[key][row, :n].tolist() == sample[key].tolist(), key
            assert batch[key][row, n:].tolist() == [pad] * (5 - n), key
    for row, sample in enumerate(samples):
        n = sample["input_ids"].numel()
        assert batch["input_mask"][row].tolist() == [True] * n + [False] * (5 - n)


def test_padded_without_mask_scores_every_real_token_only():
    samples = [{"input_ids": torch.tensor([4, 5])}, {"input_ids": torch.tensor([6, 7, 8, 9])}]
    batch = collate_padded(samples)
    assert batch["input_ids"].tolist() == [[4, 5, 0, 0], [6, 7, 8, 9]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_padded_keeps_bool_masks_bool():
    samples = [
        {"input_ids": torch.tensor([1]), "loss_mask": torch.tensor([True])},
        {"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([True, True])},
    ]
    mask = collate_padded(samples)["loss_mask"]
    assert mask.dtype == torch.bool and mask.tolist() == [[True, False], [True, True]]


def test_packed_concatenates_and_cu_seqlens_match_lengths():
    samples = _samples()
    batch = collate_packed(samples)
    assert set(batch) == {"input_ids", "loss_mask", "labels", "position_ids", "cu_seqlens"}
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, 3, 8, 9]
    assert batch["input_ids"].dtype == torch.int64
    for key in ("input_ids", "loss_mask", "labels", "position_ids"):
        assert batch[key].shape == (1, 9), key
        expected = [v for s in samples for v in s[key].tolist()]
        assert batch[key][0].tolist() == expected, key


def test_packed_without_mask_is_all_ones():
    batch = collate_packed([{"input_ids": torch.tensor([1, 2])}, {"input_ids": torch.tensor([3])}])
    assert batch["loss_mask"].tolist() == [[1.0, 1.0, 1.0]]
    assert batch["cu_seqlens"].tolist() == [0, 2, 3]


@pytest.mark.parametrize("collate", [collate_padded, collate_packed])
@pytest.mark.parametrize(
    ("samples", "match"),
    [
        ([], "samples=\\[\\] is empty"),
        ([{"labels": torch.tensor([1])}], "needs an 'input_ids'"),
        ([{"input_ids": torch.tensor([], dtype=torch.long)}], "non-empty 1-D"),
        ([{"input_ids": torch.ones(2, 2, dtype=torch.long)}], "non-empty 1-D"),
        (
            [{"input_ids": torch.tensor([1, 2]), "loss_mask": torch.ones(3)}],
            "samples\\[0\\]\\['loss_mask'\\]",
        ),
        (
            [{"input_ids": torch.tensor([1])}, {"input_ids": torch.tensor([1]), "loss_mask": torch.ones(1)}],
            "samples\\[1\\] has keys",
        ),
    ],
)
def test_malformed_samples_are_rejected(collate, samples, match):
    with pytest.raises(ValueError, match=match):
        collate(samples)
