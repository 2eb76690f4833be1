"""Saturated-softcap cases shared by ``test_cross_entropy.py`` (torch) and ``_triton_cases.py`` (Triton).

The logits reach |z| ~ 100 (up to ~400), far beyond the caps, as for outlier tokens in training: most
of them sit on the flat part of ``softcap * tanh(z / softcap)``. A row maximum taken before the cap
(z = 150 instead of s = 30) underflows every ``exp(s - max)`` (-inf loss, NaN entropy), and a tanh
built from ``exp(2x)`` overflows (NaN).
"""

from __future__ import annotations

import torch

from lightning_cp.ops import (
    cross_entropy_with_stats,
    linear_cross_entropy_with_stats,
    token_logprobs_with_entropy,
)
from tests.ops import _reference as ref
from tests.ops._reference import assert_close, make_case, upcast_leaves

N, H, V = 37, 16, 50
SOFTCAPS = (30.0, 3.0)
PATHS = ("linear", "logits", "logprobs")


def check_saturated_softcap(path: str, softcap: float, impl: str, device: torch.device) -> None:
    """One loss path (``linear``, ``logits`` or ``logprobs``) against the fp32 reference: values, token
    statistics and gradients, all finite."""
    hidden, weight, labels = make_case(N, H, V)
    hidden = hidden.detach().to(device).requires_grad_()
    weight = (weight.detach() * 60).to(device).requires_grad_()
    labels = labels.to(device)
    assert (ref.head_logits(hidden.detach(), weight.detach()).abs().amax(-1) > 4 * softcap).all()
    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    common = {"softcap": softcap, "chunk_size": 8, "impl": impl}
    if path == "logprobs":
        leaves, ref_leaves = [hidden, weight], [ref_hidden, ref_weight]
        logprobs, entropy = token_logprobs_with_entropy(hidden, weight, labels, temperature=0.7, **common)
        (logprobs.sum() + 0.5 * entropy.sum()).backward()
        expected = ref.logprobs_and_entropy(ref.head_logits(ref_hidden, ref_weight, softcap, 0.7), labels)
        (expected[0].sum() + 0.5 * expected[1].sum()).backward()
        pairs = list(zip((logprobs, entropy), expected, strict=True))
    else:
        if path == "linear":
            leaves, ref_leaves = [hidden, weight], [ref_hidden, ref_weight]
            loss, stats = linear_cross_entropy_with_stats(hidden, weight, labels, **common)
            z = ref.head_logits(ref_hidden, ref_weight, softcap)
        else:
            logits = (hidden @ weight.t()).detach().requires_grad_()
            leaves, ref_leaves = [logits], upcast_leaves(logits)
            loss, stats = cross_entropy_with_stats(logits, labels, **common)
            z = ref.transform(ref_leaves[0], softcap)
        loss.backward()
        expected = ref.cross_entropy(z, labels)
        expected.backward()
        reference_stats = ref.token_stats(z, labels)
        pairs = [
            (loss, expected),
            (stats.nll, reference_stats["nll"]),
            (stats.entropy, reference_stats["entropy"]),
        ]
    for got, want in pairs:
        assert torch.isfinite(got).all()
        assert_close(got, want)
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert_close(leaf.grad, ref_leaf.grad)
