import megatron.core.utils as megatron_utils
import pytest
import torch

from lightning_cp.constants import IGNORE_INDEX
from lightning_cp.parallel import CPSplit, shard_batch, unshard
from lightning_cp.parallel.sharding import sharded_under_cp


def _reference_targets(input_ids, lengths, loss_mask=None):
    """Next-token labels and mask of one row made of sequences of ``lengths``, by a plain loop."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    mask = torch.zeros(input_ids.shape, dtype=torch.float32)
    start = 0
    for length in lengths:
        for t in range(start, start + length - 1):
            if loss_mask is None or loss_mask[t + 1]:
                labels[t] = input_ids[t + 1]
                mask[t] = 1.0
        start += length
    return labels, mask


def _reference_local(values, lengths, cp, rank, fill):
    """The tokens rank ``rank`` keeps: per sequence, pad to 2*cp chunks and take chunks rank, 2cp-1-rank."""
    out, start = [], 0
    for length in lengths:
        chunk = -(-length // (2 * cp))
        seq = list(values[start : start + length]) + [fill] * (2 * chunk * cp - length)
        out += (
            seq[rank * chunk : (rank + 1) * chunk]
            + seq[(2 * cp - 1 - rank) * chunk : (2 * cp - rank) * chunk]
        )
        start += length
    return torch.tensor(out)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_padded_matches_megatron_get_batch_on_this_cp_rank(cp, monkeypatch):
    torch.manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 100, (3, 16)),
        "loss_mask": (torch.rand(3, 16) > 0.3).float(),
        "extra": torch.randn(3, 16, 5),
    }
    # The Megatron input is the already-shifted full batch, built independently of shard_batch.
    labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    labels[:, :-1] = batch["input_ids"][:, 1:]
    mask = torch.zeros(3, 16)
    mask[:, :-1] = batch["loss_mask"][:, 1:]
    labels[mask == 0] = IGNORE_INDEX
    full = {
        "input_ids": batch["input_ids"],
        "labels": labels,
        "loss_mask": mask,
        "position_ids": torch.arange(16).expand(3, 16),
        "extra": batch["extra"],
    }
    monkeypatch.setattr(megatron_utils.parallel_state, "get_context_parallel_world_size", lambda: cp)
    for rank in range(cp):
        monkeypatch.setattr(
            megatron_utils.parallel_state, "get_context_parallel_rank", lambda rank=rank: rank
        )
        expected = megatron_utils.get_batch_on_this_cp_rank(dict(full))
        ours = shard_batch(batch, cp, rank)
        assert ours.pop("input_mask").all()
        assert ours.pop("cp_shard").split == CPSplit(cp, rank)
        assert ours.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(ours[key], expected[key].to(ours[key].dtype), rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_padded_odd_length_is_padded_and_padding_is_never_a_target(cp):
    input_ids = torch.randint(1, 50, (2, 13))
    shards = [shard_batch({"input_ids": input_ids}, cp, r) for r in range(cp)]
    padded = -(-13 // (2 * cp)) * 2 * cp
    for r, shard in enumerate(shards):
        assert shard["input_ids"].shape == (2, padded // cp)
        for row in range(2):
            ref_labels, ref_mask = _reference_targets(input_ids[row], [13])
            assert torch.equal(
                shard["input_ids"][row], _reference_local(input_ids[row].tolist(), [13], cp, r, 0)
            )
            assert torch.equal(
                shard["labels"][row], _reference_local(ref_labels.tolist(), [13], cp, r, IGNORE_INDEX)
            )
            assert torch.equal(shard["loss_mask"][row], _reference_local(ref_mask.tolist(), [13], cp, r, 0.0))
            assert torch.equal(
                shard["position_ids"][row], _reference_local(list(range(padded)), [padded], cp, r, 0)
            )
    total_targets = sum(s["loss_mask"].sum() for s in shards)
    assert total_targets == 2 * 12
    assert sum(s["input_mask"].sum() for s in shards) == 2 * 13


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_packed_split_per_sequence(cp):
    lengths = [5, 1, 9, 8, 3]
    cu = torch.tensor([0, 5, 6, 15, 23, 26], dtype=torch.int32)
    input_ids = torch.randint(1, 50, (1, 26))
    loss_mask = (torch.rand(1, 26) > 0.4).float()
    ref_labels, ref_mask = _reference_targets(input_ids[0], lengths, loss_mask[0])
    positions = [p for n in lengths for p in range(n)]
    for r in range(cp):
        shard = shard_batch({"input_ids": input_ids, "cu_seqlens": cu, "loss_mask": loss_mask}, cp, r)
        assert torch.equal(shard["input_ids"][0], _reference_local(input_ids[0].tolist(), lengths, cp, r, 0))
        assert torch.equal(
            shard["labels"][0], _reference_local(ref_labels.tolist(), lengths, cp, r, IGNORE_INDEX)
        )
        assert torch.equal(shard["loss_mask"][0], _reference_local(ref_mask.tolist(), lengths, cp, r, 0.0))
        local_pos = _reference_local(positions, lengths, cp, r, -1)
        real = local_pos >= 0
        assert torch.equal(shard["position_ids"][0][real], local_pos[real])
        local_lengths = [2 * -(-n // (2 * cp)) for n in lengths]
        assert shard["cu_seqlens"].tolist() == [0] + torch.tensor(local_lengths).cumsum(0).tolist()
        assert (
            shard["cu_seqlens_padded"].tolist() == [0] + (torch.tensor(local_lengths) * cp).cumsum(0).tolist()
        )
        assert shard["cu_seqlens"].dtype == torch.int32


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_shard_then_unshard_is_identity_and_each_token_on_one_rank(cp, packed):
    if packed:
        cu = torch.tensor([0, 7, 8, 20, 31])
        batch = {"input_ids": torch.randint(1, 99, (1, 31)), "cu_seqlens": cu}
    else:
        cu = None
        batch = {"input_ids": torch.randint(1, 99, (3, 21))}
    rows, total = batch["input_ids"].shape
    batch["token_index"] = torch.arange(1, rows * total + 1).view(rows, total)
    shards = [shard_batch(batch, cp, r) for r in range(cp)]
    for key in ("input_ids", "token_index"):
        rebuilt = unshard([s[key] for s in shards], seq_len=None if packed else total, cu_seqlens=cu)
        assert torch.equal(rebuilt, batch[key])
    owned = torch.cat([s["token_index"].flatten() for s in shards])
    owned = owned[owned > 0]
    assert torch.equal(owned.sort().values, torch.arange(1, rows * total + 1))


def test_labels_given_are_shifted_and_ignore_index_respected():
    input_ids = torch.tensor([[1, 2, 3, 4]])
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 30, 40]])  # prompt tokens 1, 2 are not targets
    shard = shard_batch({"input_ids": input_ids, "labels": labels}, 1, 0)
    assert shard["labels"].tolist() == [[IGNORE_INDEX, 30, 40, IGNORE_INDEX]]
    assert shard["loss_mask"].tolist() == [[0.0, 1.0, 1.0, 0.0]]


@pytest.mark.parametrize("cp", [1, 2])
def test_values_about_a_target_token_follow_its_label(cp):
    """Packed rollouts (prompt, then completion): each advantage / log-prob sits with the label of its token."""
    cu = torch.tensor([0, 5, 9])  # two documents: prompts of 2 and 1 tokens, completions of 3 and 3
    input_ids = torch.tensor([[11, 12, 13, 14, 15, 21, 22, 23, 24]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1]])
    logp = -input_ids.float() / 100 * loss_mask  # each completion token's value names its token
    advantage = torch.tensor([[0, 0, 2.0, 2.0, 2.0, 0, -1.0, -1.0, -1.0]])
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "cu_seqlens": cu}
    batch |= {"old_logprobs": logp, "ref_logprobs": 2 * logp, "advantages": advantage}
    shards = [shard_batch(batch, cp, r) for r in range(cp)]
    keys = ("labels", "old_logprobs", "ref_logprobs", "advantages")
    full = {key: unshard([s[key] for s in shards], cu_seqlens=cu) for key in keys}
    assert full["labels"].tolist() == [[-100, 13, 14, 15, -100, 22, 23, 24, -100]]
    has_target = full["labels"] != IGNORE_INDEX
    assert torch.equal(full["old_logprobs"], torch.where(has_target, -full["labels"].float() / 100, 0.0))
    assert torch.equal(full["ref_logprobs"], 2 * full["old_logprobs"])
    assert full["advantages"].tolist() == [[0, 2.0, 2.0, 2.0, 0, -1.0, -1.0, -1.0, 0]]


def test_a_target_value_that_is_not_one_float_per_token_is_refused():
    batch = {
        "input_ids": torch.zeros(1, 8, dtype=torch.long),
        "advantages": torch.ones(1, 8, dtype=torch.long),
    }
    with pytest.raises(ValueError, match=r"batch\['advantages'\] must be a float tensor of input_ids' shape"):
        shard_batch(batch, 1, 0)
    with pytest.raises(ValueError, match="one value per token"):
        shard_batch({"input_ids": batch["input_ids"], "old_logprobs": torch.ones(1, 7)}, 1, 0)


@pytest.mark.parametrize(
    ("batch", "cp", "rank", "match"),
    [
        ({"tokens": torch.zeros(1, 4, dtype=torch.long)}, 2, 0, "'input_ids'"),
        ([torch.zeros(1, 4)], 2, 0, "'input_ids'"),
        ({"input_ids": torch.zeros(4, dtype=torch.long)}, 2, 0, "2-D integer"),
        ({"input_ids": torch.zeros(1, 4)}, 2, 0, "2-D integer"),
        (
            {"input_ids": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 3, 6])},
            2,
            0,
            "end at",
        ),
        (
            {"input_ids": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 5, 3, 8])},
            2,
            0,
            "increase",
        ),
        (
            {"input_ids": torch.zeros(2, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 8])},
            2,
            0,
            r"\[1, T\]",
        ),
        (
            {"input_ids": torch.zeros(1, 8, dtype=torch.long), "loss_mask": torch.ones(1, 7)},
            2,
            0,
            "loss_mask",
        ),
        ({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, 0, 0, "cp_size"),
        ({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, 2, 2, "cp_rank"),
    ],
)
def test_bad_input_is_a_clear_error(batch, cp, rank, match):
    with pytest.raises(ValueError, match=match):
        shard_batch(batch, cp, rank)


def test_a_split_needs_integer_sizes():
    with pytest.raises(TypeError, match="cp_size=2.0"):
        shard_batch({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, 2.0, 0)
    with pytest.raises(TypeError, match="cp_rank=True"):
        CPSplit(2, True)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cp_shard_knows_the_sequence_of_every_local_token(cp, packed):
    lengths = [5, 1, 9, 8, 3] if packed else [11, 11, 11]
    rows, total = (1, sum(lengths)) if packed else (len(lengths), lengths[0])
    batch = {"input_ids": torch.zeros(rows, total, dtype=torch.long)}
    # Every token tagged with 1 + its sequence (row, or packed document); CP padding gets 0.
    if packed:
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        batch["tag"] = torch.arange(1, len(lengths) + 1).repeat_interleave(torch.tensor(lengths))[None]
    else:
        batch["tag"] = torch.arange(1, rows + 1)[:, None].expand(rows, total)
    for rank in range(cp):
        shard = shard_batch(batch, cp, rank)
        index, tag = shard["cp_shard"].sequence_index, shard["tag"].flatten()
        assert index.dtype == torch.int64 and index.shape == tag.shape
        assert torch.equal(index[tag > 0], tag[tag > 0] - 1)
        assert shard["cp_shard"].num_sequences == len(lengths)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_owner_of_a_chunk_keeps_it(cp):
    chunks = torch.arange(2 * cp)
    rank, slot = CPSplit(cp, 0).owner(chunks)
    for chunk, r, s in zip(chunks.tolist(), rank.tolist(), slot.tolist()):
        assert CPSplit(cp, r).kept_chunks[s] == chunk


def test_only_position_ids_split_over_several_ranks_are_marked():
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long), "position_ids": torch.arange(8).expand(2, 8)}
    assert not sharded_under_cp(batch["position_ids"])
    assert not sharded_under_cp(shard_batch(batch, 1, 0)["position_ids"])  # cp = 1: whole sequences
    shard = shard_batch(batch, 2, 1)
    assert sharded_under_cp(shard["position_ids"]) and shard["cp_shard"].position_ids is shard["position_ids"]
    assert not sharded_under_cp(shard["position_ids"].clone()) and not sharded_under_cp(batch["position_ids"])
