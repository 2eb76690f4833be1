import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchmetrics import MetricCollection
from torchmetrics.functional.classification import multiclass_accuracy
from torchmetrics.text import Perplexity

from lightning_cp.loss.metrics import (
    InputTokenCount,
    MeanTokenEntropy,
    MeanTokenLoss,
    SequencePerplexity,
    TargetTokenCount,
    TokenAccuracy,
    TokenPerplexity,
    TokensPerSecond,
    sequence_totals,
)
from lightning_cp.parallel import groups
from lightning_cp.parallel.layout import set_current_layout

IGNORE = -100
_SEQ_STATS = ("mean", "min", "max", "count")


def _all_metrics(token_group=None, sequence_group=None, **kwargs) -> dict:
    metrics = {
        "loss": MeanTokenLoss(token_group, **kwargs),
        "ppl": TokenPerplexity(token_group, **kwargs),
        "acc": TokenAccuracy(token_group, **kwargs),
        "entropy": MeanTokenEntropy(token_group, **kwargs),
        "input_tokens": InputTokenCount(token_group, **kwargs),
        "target_tokens": TargetTokenCount(token_group, **kwargs),
        "tps": TokensPerSecond(token_group, **kwargs),
    }
    metrics.update({f"seq_{s}": SequencePerplexity(s, sequence_group, **kwargs) for s in _SEQ_STATS})
    return metrics


def _lm_batch(seed: int, batch: int = 3, seq: int = 6, vocab: int = 7):
    """Logits, labels with ignored targets (one sequence fully ignored), and an input padding mask."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=g) * 2
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < 0.3] = IGNORE
    labels[-1] = IGNORE
    labels[0, 0] = 1  # at least one target in every batch
    input_mask = torch.rand(batch, seq, generator=g) < 0.8
    return logits, labels, input_mask


def _token_stats(logits, labels):
    """What a training step hands to the metrics: sums over its tokens, from plain PyTorch ops."""
    valid = labels != IGNORE
    nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="none")
    logp = logits.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    correct = (logits.argmax(-1) == labels) & valid
    return nll.view(labels.shape), valid, correct, entropy


def test_token_metrics_match_library_references():
    batches = [_lm_batch(0), _lm_batch(1, batch=2, seq=9)]
    ours = _all_metrics()
    ref_ppl = Perplexity(ignore_index=IGNORE)
    for logits, labels, input_mask in batches:
        nll, valid, correct, entropy = _token_stats(logits, labels)
        ours["loss"].update(nll.sum(), valid.sum())
        ours["ppl"].update(loss_sum=nll.sum(), valid_count=valid.sum())
        ours["acc"].update(correct.sum(), valid.sum())
        ours["entropy"].update((entropy * valid).sum(), valid.sum())
        ours["input_tokens"].update(input_mask.sum())
        ours["target_tokens"].update(valid.sum())
        ref_ppl.update(logits, labels)

    logits = torch.cat([b[0].flatten(0, 1) for b in batches])
    labels = torch.cat([b[1].flatten() for b in batches])
    valid = labels != IGNORE
    torch.testing.assert_close(
        ours["loss"].compute().float(), F.cross_entropy(logits, labels, ignore_index=IGNORE)
    )
    torch.testing.assert_close(ours["ppl"].compute().float(), ref_ppl.compute())
    ref_acc = multiclass_accuracy(
        logits, labels, num_classes=logits.shape[-1], average="micro", ignore_index=IGNORE
    )
    torch.testing.assert_close(ours["acc"].compute().float(), ref_acc)
    ref_entropy = torch.distributions.Categorical(logits=logits[valid]).entropy().mean()
    torch.testing.assert_close(ours["entropy"].compute().float(), ref_entropy)
    assert ours["target_tokens"].compute().item() == sum(t != IGNORE for t in labels.tolist())
    assert ours["input_tokens"].compute().item() == sum(sum(b[2].flatten().tolist()) for b in batches)


def test_sequence_perplexity_matches_per_sequence_loop():
    metrics = {s: SequencePerplexity(s) for s in _SEQ_STATS}
    per_sequence_ppl = []
    for seed in (2, 3):  # two updates accumulate
        logits, labels, _ = _lm_batch(seed, batch=4)
        nll, valid, _, _ = _token_stats(logits, labels)
        seq_index = torch.arange(labels.shape[0]).repeat_interleave(labels.shape[1])
        per_token = torch.stack([nll.flatten(), valid.flatten()], 1)
        totals = sequence_totals(per_token, seq_index, labels.shape[0], None)
        for m in metrics.values():
            m.update(totals[:, 0], totals[:, 1])
        for i in range(labels.shape[0]):
            if (labels[i] != IGNORE).any():  # a sequence with no target has no perplexity
                mean_nll = F.cross_entropy(logits[i], labels[i], ignore_index=IGNORE)
                per_sequence_ppl.append(mean_nll.exp().item())

    assert len(per_sequence_ppl) == 6
    assert metrics["count"].compute().item() == len(per_sequence_ppl)
    mean_ppl = sum(per_sequence_ppl) / len(per_sequence_ppl)
    assert metrics["mean"].compute().item() == pytest.approx(mean_ppl, rel=1e-5)
    assert metrics["min"].compute().item() == pytest.approx(min(per_sequence_ppl), rel=1e-5)
    assert metrics["max"].compute().item() == pytest.approx(max(per_sequence_ppl), rel=1e-5)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.bfloat16, torch.float32), (torch.bool, torch.float32), (torch.float64, torch.float64)],
)
def test_sequence_totals_without_group_match_loop(dtype, expected):
    g = torch.Generator().manual_seed(4)
    values = (torch.rand(11, 2, generator=g) * 4).round().to(dtype)
    seq_index = torch.tensor([2, 0, 0, 2, 2, 1, 0, 2, 4, 4, 0])
    totals = sequence_totals(values, seq_index, 5, None)
    flat = sequence_totals(values[:, 0], seq_index, 5, None)
    loop = torch.zeros(5, 2, dtype=torch.float64)
    for value, s in zip(values.double().tolist(), seq_index.tolist()):
        loop[s] += torch.tensor(value, dtype=torch.float64)
    assert totals.dtype == flat.dtype == expected
    assert totals.shape == (5, 2) and flat.shape == (5,)
    # Sequence 3 has no token: its total is 0.
    assert torch.equal(totals.double(), loop) and torch.equal(flat.double(), loop[:, 0])


def test_sequence_totals_are_detached():
    values = torch.rand(4, requires_grad=True)
    assert not sequence_totals(values * 2, torch.tensor([0, 1, 1, 0]), 2, None).requires_grad


def test_no_data_gives_zero_token_values_and_no_sequence_perplexity():
    metrics = _all_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics warns about compute() before update()
        before = {k: m.compute().item() for k, m in metrics.items()}
    for k in ("loss", "ppl", "acc", "entropy"):
        metrics[k].update(0.0, 0)
    metrics["tps"].update(0, 0.0)
    for s in _SEQ_STATS:
        metrics[f"seq_{s}"].update(torch.tensor([0.0, 3.0]), torch.tensor([0, 0]))  # sequences with no target
    after = {k: m.compute().item() for k, m in metrics.items() if k not in ("input_tokens", "target_tokens")}
    # Perplexity is exp(mean loss) with the empty mean taken as 0.0, so it reads 1.0. A sequence without
    # targets has no perplexity: mean / min / max of none is nan (not a made-up 0.0), the count is 0.
    expected = {k: 1.0 if k == "ppl" else 0.0 for k in metrics}
    expected.update({f"seq_{s}": float("nan") for s in ("mean", "min", "max")})
    assert before == pytest.approx(expected, nan_ok=True)
    assert after == pytest.approx({k: expected[k] for k in after}, nan_ok=True)


def test_updates_accumulate_forward_gives_the_step_value_and_reset_clears():
    loss = MeanTokenLoss()
    assert loss(6.0, 2).item() == 3.0  # forward: this step's value
    assert loss(torch.tensor(2.0), torch.tensor(8)).item() == 0.25
    assert loss.compute().item() == 8.0 / 10.0
    loss.reset()
    loss.update(1.0, 4)
    assert loss.compute().item() == 0.25

    seq = SequencePerplexity("min")
    seq(torch.tensor([2.0]), torch.tensor([1.0]))
    seq(torch.tensor([1.0, 9.0]), torch.tensor([1.0, 3.0]))
    assert seq.compute().item() == pytest.approx(math.e)

    # Seconds of successive steps add up on a rank (only the cross-rank reduction takes the max).
    tps = TokensPerSecond()
    assert tps(100, 1.0).item() == 100.0
    assert tps(300, 1.0).item() == 300.0
    assert tps.compute().item() == 200.0


def test_collection_keeps_metrics_apart_after_an_all_zero_first_update():
    """A MetricCollection merges metrics whose states are equal after the first update; an all-zero
    first step (a rank without targets) must not merge metrics that are fed different inputs."""
    collection = MetricCollection(_all_metrics())
    zero = {
        "loss_sum": 0.0,
        "correct_count": 0,
        "entropy_sum": 0.0,
        "valid_count": 0,
        "input_count": 0,
        "seconds": 0.0,
    }
    empty = {"seq_nll_sum": torch.zeros(1), "seq_valid_count": torch.zeros(1)}
    collection.update(**zero, **empty)
    step = {
        "loss_sum": 6.0,
        "correct_count": 3,
        "entropy_sum": 2.0,
        "valid_count": 4,
        "input_count": 5,
        "seconds": 2.0,
    }
    collection.update(**step, seq_nll_sum=torch.tensor([2.0, 4.0]), seq_valid_count=torch.tensor([2.0, 2.0]))
    got = {k: v.item() for k, v in collection.compute().items()}
    expected = {
        "loss": 1.5,
        "ppl": math.exp(1.5),
        "acc": 0.75,
        "entropy": 0.5,
        "input_tokens": 5.0,
        "target_tokens": 4.0,
        "tps": 2.5,
        "seq_mean": (math.e + math.e**2) / 2,
        "seq_min": math.e,
        "seq_max": math.e**2,
        "seq_count": 2.0,
    }
    assert got == pytest.approx(expected, rel=1e-12)


def test_states_stay_float64_under_a_module_dtype_cast():
    """Lightning's "bf16-true" precision calls module.to(bfloat16); counts must stay exact past 2**24."""
    holder = torch.nn.ModuleDict({"tokens": TargetTokenCount(), "loss": MeanTokenLoss()}).to(torch.bfloat16)
    big = 2**24 + 1
    holder["tokens"].update(big)
    holder["loss"].update(big * 0.5 + 0.25, big)
    assert holder["tokens"].valid_count.dtype == torch.float64
    assert holder["tokens"].compute().item() == big
    assert holder["loss"].compute().item() == (big * 0.5 + 0.25) / big


def test_invalid_arguments_are_rejected():
    with pytest.raises(ValueError, match=r"loss_sum must be a scalar.*\(3,\)"):
        MeanTokenLoss().update(torch.ones(3), 3)
    with pytest.raises(ValueError, match="seq_nll_sum and seq_valid_count must both be"):
        SequencePerplexity().update(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match="statistic must be one of.*'median'"):
        SequencePerplexity("median")
    with pytest.raises(ValueError, match=r"sequence_index \(4,\)"):
        sequence_totals(torch.ones(3), torch.zeros(4, dtype=torch.long), 1, None)


@pytest.mark.gpu
def test_metrics_follow_the_module_to_cuda():
    loss = MeanTokenLoss().cuda()
    loss.update(torch.tensor(3.0, device="cuda"), torch.tensor(4, device="cuda"))
    seq = SequencePerplexity("max").cuda()
    seq.update(torch.tensor([1.0, 4.0], device="cuda"), torch.tensor([1.0, 2.0], device="cuda"))
    assert loss.loss_sum.device.type == "cuda" and loss.loss_sum.dtype == torch.float64
    assert loss.compute().item() == 0.75
    assert seq.compute().item() == pytest.approx(math.e**2)


# ---- distributed: the same data over (dp=4, cp=1), (dp=2, cp=2), (dp=1, cp=4) ----

_STEPS, _BATCH, _SEQ = 2, 4, 16  # _SEQ divisible by 2 * 4 for the load-balanced CP split
_STEP_SECONDS = (0.5, 0.25)
_RANK_SKEW_S = 0.01


def _dist_data() -> dict:
    """Per-token statistics of two steps of ``[_BATCH, _SEQ]`` tokens, with uneven masks."""
    g = torch.Generator().manual_seed(5)
    shape = (_STEPS, _BATCH, _SEQ)
    lengths = torch.randint(4, _SEQ + 1, (_STEPS, _BATCH, 1), generator=g)
    pos = torch.arange(_SEQ)
    input_mask = pos < lengths
    valid = (pos < lengths - 1) & (torch.rand(shape, generator=g) < 0.7)
    valid[0, 0] = False  # no target at all in step 0's first sequence (and on rank 0 when dp = 4)
    valid[0, 1, 2:] = False  # targets only in the first CP chunk of the smallest split
    valid[0, 1, :2] = True
    return {
        "input": input_mask,
        "valid": valid,
        "nll": torch.rand(shape, generator=g) * 4,
        "correct": (torch.rand(shape, generator=g) < 0.4) & valid,
        "entropy": torch.rand(shape, generator=g) * 3,
    }


def _local(x: torch.Tensor, dp: int, cp: int, dp_rank: int, cp_rank: int) -> torch.Tensor:
    """This rank's tokens of ``[B, S]``: a DP share of the rows, then CP chunks r and 2*cp-1-r of each row."""
    chunks = x.chunk(dp, dim=0)[dp_rank].chunk(2 * cp, dim=1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=1)


def _run_layouts(data: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for cp in (1, 2, 4):
        dp = world // cp
        # Built before Megatron's groups exist, as in a LightningModule's __init__; synchronized in
        # forward too, for the per-step values a training step logs.
        lazy = MetricCollection(_all_metrics(dist_sync_on_step=True))
        layout = groups.initialize(tp=1, cp=cp)
        set_current_layout(layout)
        try:
            assert (layout.cp_rank, layout.dp_rank) == (rank % cp, rank // cp)
            explicit = MetricCollection(
                _all_metrics(layout.loss_group, layout.dp_group),
                compute_groups=False,
            )
            totals, steps = [], []
            for step in range(_STEPS):
                local = {k: _local(v[step], dp, cp, rank // cp, rank % cp) for k, v in data.items()}
                n_seq, n_tok = local["valid"].shape
                seq_index = torch.arange(n_seq).repeat_interleave(n_tok)
                masked_nll = local["nll"] * local["valid"]
                per_token = torch.stack([masked_nll.flatten(), local["valid"].flatten()], 1)
                seq = sequence_totals(per_token, seq_index, n_seq, layout.cp_group)
                totals.append(seq)
                kwargs = {
                    "loss_sum": masked_nll.sum(),
                    "valid_count": local["valid"].sum(),
                    "correct_count": local["correct"].sum(),
                    "entropy_sum": (local["entropy"] * local["valid"]).sum(),
                    "input_count": local["input"].sum(),
                    "seconds": _STEP_SECONDS[step] + _RANK_SKEW_S * rank,
                    "seq_nll_sum": seq[:, 0],
                    "seq_valid_count": seq[:, 1],
                }
                steps.append(lazy(**kwargs))
                explicit.update(**kwargs)
            out[cp] = {"lazy": lazy.compute(), "explicit": explicit.compute(), "totals": totals}
            out[cp].update({f"step{i}": value for i, value in enumerate(steps)})
        finally:
            set_current_layout(None)
            groups.destroy()
    return out


def _reference(data: dict, steps: list[int]) -> dict:
    """The single-process values on the full data of ``steps``, from plain PyTorch in float64."""
    data = {k: v[steps] for k, v in data.items()}
    valid = data["valid"]
    n_valid = valid.sum().double()
    nll = (data["nll"].double() * valid).sum()
    seq_nll = (data["nll"].double() * valid).sum(-1).flatten()
    seq_count = valid.sum(-1).flatten().double()
    seq_ppl = (seq_nll[seq_count > 0] / seq_count[seq_count > 0]).exp()
    slowest_rank_seconds = sum(_STEP_SECONDS[s] for s in steps) + len(steps) * _RANK_SKEW_S * 3
    return {
        "loss": nll / n_valid,
        "ppl": (nll / n_valid).exp(),
        "acc": data["correct"].sum().double() / n_valid,
        "entropy": (data["entropy"].double() * valid).sum() / n_valid,
        "input_tokens": data["input"].sum().double(),
        "target_tokens": n_valid,
        "tps": data["input"].sum().double() / slowest_rank_seconds,
        "seq_mean": seq_ppl.mean(),
        "seq_min": seq_ppl.min(),
        "seq_max": seq_ppl.max(),
        "seq_count": torch.tensor(float(seq_ppl.numel()), dtype=torch.float64),
    }


def test_metrics_are_identical_for_every_dp_cp_layout(world4):
    data = _dist_data()
    references = {"lazy": _reference(data, list(range(_STEPS)))}
    references["explicit"] = references["lazy"]
    references.update({f"step{s}": _reference(data, [s]) for s in range(_STEPS)})
    assert 0 < references["lazy"]["seq_count"] < _STEPS * _BATCH  # some sequences are skipped
    results = world4.run(_run_layouts, data)
    for cp in (1, 2, 4):
        dp = 4 // cp
        for variant, ref in references.items():
            values = [r[cp][variant] for r in results]
            for name, expected in ref.items():
                for rank, v in enumerate(values):
                    assert torch.equal(v[name], values[0][name]), (cp, variant, name, rank)
                msg = f"{cp=} {variant} {name}"
                torch.testing.assert_close(values[0][name], expected, rtol=1e-5, atol=0, msg=msg)

        # Every CP peer holds the complete per-sequence totals of its DP share of the sequences.
        for rank, r in enumerate(results):
            for step, got in enumerate(r[cp]["totals"]):
                rows = slice((rank // cp) * _BATCH // dp, (rank // cp + 1) * _BATCH // dp)
                valid = data["valid"][step, rows]
                expected = torch.stack([(data["nll"][step, rows] * valid).sum(-1), valid.sum(-1).float()], 1)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
                assert torch.equal(got, results[rank - rank % cp][cp]["totals"][step])
