import pytest
import torch

from lightning_cp.data import LongRangeCopyDataset


@pytest.mark.parametrize("min_len", [None, 4])
def test_second_half_copies_first_and_only_it_is_scored(min_len):
    ds = LongRangeCopyDataset(num_samples=20, seq_len=16, vocab_size=50, seed=3, min_len=min_len)
    for i in range(len(ds)):
        sample = ds[i]
        ids, mask = sample["input_ids"], sample["loss_mask"]
        half = ids.numel() // 2
        assert ids.dtype == torch.int64 and ids.dim() == 1
        assert torch.equal(ids[half:], ids[:half])
        expected_mask = torch.cat([torch.zeros(half), torch.ones(half)])
        assert mask.dtype == torch.float32 and torch.equal(mask, expected_mask)


def test_sample_is_drawn_from_generator_seeded_with_seed_plus_index():
    ds = LongRangeCopyDataset(num_samples=5, seq_len=12, vocab_size=1000, seed=7)
    for i in range(5):
        expected = torch.randint(0, 1000, (6,), generator=torch.Generator().manual_seed(7 + i))
        assert torch.equal(ds[i]["input_ids"][:6], expected)


def test_deterministic_across_instances_and_distinct_across_indices():
    a = LongRangeCopyDataset(num_samples=8, seq_len=32, seed=1, min_len=8)
    b = LongRangeCopyDataset(num_samples=8, seq_len=32, seed=1, min_len=8)
    for i in reversed(range(8)):  # access order must not matter
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"])
    firsts = {tuple(a[i]["input_ids"][:4].tolist()) for i in range(8)}
    assert len(firsts) == 8
    other_seed = LongRangeCopyDataset(num_samples=8, seq_len=32, seed=100)
    assert not torch.equal(other_seed[0]["input_ids"], LongRangeCopyDataset(8, 32, seed=1)[0]["input_ids"])


def test_tokens_cover_the_vocabulary_and_stay_inside_it():
    small = LongRangeCopyDataset(num_samples=50, seq_len=16, vocab_size=5)
    tokens = torch.cat([small[i]["input_ids"] for i in range(len(small))])
    assert set(tokens.tolist()) == set(range(5))

    default = LongRangeCopyDataset(num_samples=4, seq_len=512)
    assert default.vocab_size == 32768
    tokens = torch.cat([default[i]["input_ids"] for i in range(4)])
    assert tokens.min() >= 0 and tokens.max() < 32768
    assert tokens.max() > 16384  # really uses the large vocabulary


def test_variable_lengths_are_even_within_range_and_cover_it():
    ds = LongRangeCopyDataset(num_samples=200, seq_len=16, vocab_size=10, min_len=6)
    lengths = [ds[i]["input_ids"].numel() for i in range(len(ds))]
    assert set(lengths) == {6, 8, 10, 12, 14, 16}
    fixed = LongRangeCopyDataset(num_samples=10, seq_len=16, vocab_size=10)
    assert {fixed[i]["input_ids"].numel() for i in range(10)} == {16}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 15}, "seq_len=15"),
        ({"seq_len": 0}, "seq_len=0"),
        ({"seq_len": 16, "min_len": 5}, "min_len=5"),
        ({"seq_len": 16, "min_len": 18}, "min_len=18 is larger than seq_len=16"),
        ({"seq_len": 16, "vocab_size": 1}, "vocab_size=1"),
        ({"seq_len": 16, "num_samples": 0}, "num_samples=0"),
    ],
)
def test_invalid_arguments_are_named(kwargs, match):
    kwargs = {"num_samples": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        LongRangeCopyDataset(**kwargs)


def test_index_out_of_range():
    with pytest.raises(IndexError, match="index=4"):
        LongRangeCopyDataset(num_samples=4, seq_len=8)[4]
