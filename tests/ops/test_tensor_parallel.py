"""Vocabulary-parallel losses (torch path) on two gloo ranks vs the single-rank reference and Megatron-core.

The Triton path runs the same cases from ``_triton_cases.py`` (see ``test_triton.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_cp.ops import (
    cross_entropy,
    cross_entropy_with_stats,
    linear_cross_entropy,
)
from lightning_cp.parallel import groups
from tests.ops._reference import assert_close, make_case
from tests.ops._tp import H, V, check_against_single_rank_reference, upstream

ALL = {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 2.0}


@pytest.mark.parametrize(
    "path, reduction, options, dtype",
    [
        ("linear", "mean", ALL, torch.float32),
        ("linear", "none", {}, torch.float32),
        ("linear", "sum", {"z_loss": 1e-2}, torch.float32),
        ("logits", "mean", {"label_smoothing": 0.1}, torch.float32),
        ("logits", "none", ALL, torch.float32),
        ("logprobs", None, {"softcap": 2.0, "temperature": 0.7}, torch.float32),
        # the LM head's vocabulary-sharded bias and a logit scale (Phi, Cohere, Granite)
        ("linear", "mean", {"bias": True, "logit_scale": 0.3, "softcap": 2.0}, torch.float32),
        ("linear", "none", {"bias": True}, torch.float32),
        ("logits", "none", {"logit_scale": 2.5}, torch.float32),
        ("logprobs", None, {"bias": True, "logit_scale": 2.5, "temperature": 0.7}, torch.float32),
        # bf16: the weight gradient of each shard comes from the vocabulary-block pass
        ("linear", "mean", ALL, torch.bfloat16),
        ("logprobs", None, {"temperature": 0.7}, torch.bfloat16),
    ],
)
def test_tp2_matches_the_single_rank_reference(world2, path, reduction, options, dtype):
    check_against_single_rank_reference(world2, path, "torch", reduction, options, dtype)


def _run_against_megatron(tp: int, megatron_smoothing: float) -> dict[str, tuple[torch.Tensor, ...]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    layout = groups.initialize(tp=tp, cp=1)
    group, rank = layout.tp_group, layout.tp_rank
    seq, batch = 7, 3
    shard_size = V // tp
    hidden, weight, labels = make_case(seq * batch, H, V, ignore_every=0)  # Megatron has no ignore_index
    shard = weight.detach()[rank * shard_size : (rank + 1) * shard_size]
    up = upstream((seq * batch,), 1)

    # Megatron: [S, B, V / tp] logits of a column-parallel head, whose copy-to-region backward
    # all-reduces the input gradient over TP.
    m_logits = (hidden.detach() @ shard.t()).view(seq, batch, shard_size).requires_grad_()
    m_loss = vocab_parallel_cross_entropy(m_logits.clone(), labels.view(seq, batch), megatron_smoothing)
    (m_loss.view(-1) * up).sum().backward()
    m_grad_logits = m_logits.grad.view(-1, shard_size)
    m_grad_hidden = m_grad_logits @ shard
    if group is not None:  # the layout has no group of size 1 (None is not "the world" here)
        dist.all_reduce(m_grad_hidden, group=group)
    m_grad_weight = m_grad_logits.t() @ hidden.detach()

    # Megatron's smoothing is eps' = eps * K / (K - 1) over its K = V / tp local entries; at tp = 1 that
    # is F.cross_entropy's label smoothing with eps'.
    smoothing = megatron_smoothing * shard_size / (shard_size - 1)
    options = {
        "reduction": "none",
        "label_smoothing": smoothing,
        "tp_group": group,
        "chunk_size": 8,
        "impl": "torch",
    }
    ours_hidden, ours_shard = hidden.detach().clone().requires_grad_(), shard.clone().requires_grad_()
    loss = linear_cross_entropy(ours_hidden, ours_shard, labels, **options)
    (loss * up).sum().backward()
    ours_logits = (hidden.detach() @ shard.t()).requires_grad_()
    logits_loss = cross_entropy(ours_logits, labels, **options)
    (logits_loss * up).sum().backward()
    return {
        "megatron": (m_loss.detach().view(-1), m_grad_hidden, m_grad_weight, m_grad_logits),
        "linear": (loss.detach(), ours_hidden.grad, ours_shard.grad),
        "logits": (logits_loss.detach(), ours_logits.grad),
    }


@pytest.mark.parametrize(
    "tp, megatron_smoothing",
    [
        (2, 0.0),
        # Megatron averages the smoothing term over the *local* shard (its K is V / tp), so it is a
        # function of the full softmax, which a vocabulary-parallel loss can match, only at tp = 1.
        (1, 0.1),
    ],
)
def test_matches_megatron_vocab_parallel_cross_entropy(world2, tp, megatron_smoothing):
    for got in world2.run(_run_against_megatron, tp, megatron_smoothing):
        m_loss, m_grad_hidden, m_grad_weight, m_grad_logits = got["megatron"]
        for ours, megatron in zip(got["linear"], (m_loss, m_grad_hidden, m_grad_weight), strict=True):
            assert_close(ours, megatron)
        for ours, megatron in zip(got["logits"], (m_loss, m_grad_logits), strict=True):
            assert_close(ours, megatron)


def _run_tie_across_shards(impl: str) -> list[bool]:
    layout = groups.initialize(tp=2, cp=1)
    rank = layout.tp_rank
    logits = torch.zeros(4, V)
    logits[:, 5] = logits[:, 30] = 2.0  # equal maxima on shard 0 (ids 0..24) and shard 1 (ids 25..49)
    labels = torch.tensor([5, 30, -100, 7])
    shard = logits[:, rank * (V // 2) : (rank + 1) * (V // 2)]
    _, stats = cross_entropy_with_stats(shard, labels, tp_group=layout.tp_group, impl=impl)
    return stats.correct.tolist()


def test_correct_breaks_ties_across_shards_to_the_first_maximum(world2):
    # As torch.argmax on the full logits: the lower vocabulary id wins, whichever rank holds it.
    assert world2.run(_run_tie_across_shards, "torch") == [[True, False, False, False]] * 2
