"""The Triton kernels against plain PyTorch on materialized fp32 logits; run by ``test_triton.py``.

``test_triton.py`` runs this module twice, each time in a fresh pytest process:

* with ``TRITON_INTERPRET=1``, always: the kernels run in Triton's interpreter on CPU tensors, including
  the tensor-parallel cases, whose ``world2`` gloo workers (which inherit the variable) hold CPU
  tensors. The variable must be set before *Triton itself* is imported (its standard library,
  ``tl.max`` and friends, is decorated at import, and Megatron-core imports Triton), hence the fresh
  process;
* without it, on a CUDA machine: the kernels are compiled and run on the GPU; the gloo cases skip.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    raise RuntimeError(
        "Without CUDA these cases need TRITON_INTERPRET=1 from process start; run tests/ops/test_triton.py."
    )

pytest.importorskip("triton")

from lightning_cp.ops import (
    _engine,
    _triton_kernels,
    cross_entropy,
    cross_entropy_with_stats,
    linear_cross_entropy,
    linear_cross_entropy_with_stats,
    token_logprobs,
    token_logprobs_with_entropy,
)
from tests.ops import _reference as ref
from tests.ops import _softcap_cases
from tests.ops._reference import IGNORE, assert_close, make_bias, make_case, upcast_leaves
from tests.ops._tp import check_against_single_rank_reference

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
# 19 rows in chunks of 8: three chunks, the last partial (each row is one program the interpreter runs).
N, H, V = 19, 16, 50
ALL = {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 2.0}
SMALL_BLOCK = 16  # several vocabulary tiles per row, the last one partial: exercises the online recurrences
# Vocabulary rows per block of the low-precision weight-gradient pass: 50 = 3 * 16 + 2, the last ragged.
WEIGHT_BLOCK_ROWS = 16


def _case(dtype: torch.dtype = torch.float32):
    hidden, weight, labels = make_case(N, H, V, dtype)
    return (
        hidden.detach().to(DEVICE).requires_grad_(),
        weight.detach().to(DEVICE).requires_grad_(),
        labels.to(DEVICE),
    )


def _upstream(loss: torch.Tensor) -> torch.Tensor:
    if loss.dim() == 0:
        return torch.tensor(0.7, device=DEVICE)
    return torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)


@pytest.mark.parametrize(
    "reduction, options, dtype, block",
    [
        ("mean", {}, torch.float32, None),
        ("mean", ALL, torch.float32, SMALL_BLOCK),
        ("sum", {"z_loss": 1e-2}, torch.float32, SMALL_BLOCK),
        ("none", ALL, torch.float32, SMALL_BLOCK),
        ("none", {}, torch.float32, None),
        ("mean", ALL, torch.bfloat16, SMALL_BLOCK),
        ("none", {"label_smoothing": 0.1}, torch.bfloat16, None),
    ],
)
def test_linear_cross_entropy_matches_reference(reduction, options, dtype, block, monkeypatch):
    if block is not None:
        monkeypatch.setattr(_triton_kernels, "_MAX_BLOCK", block)
    monkeypatch.setattr(_engine, "_WEIGHT_BLOCK_BYTES", WEIGHT_BLOCK_ROWS * H * 4)
    hidden, weight, labels = _case(dtype)
    labels[1::2] = ref.head_logits(hidden.detach(), weight.detach(), options.get("softcap")).argmax(-1)[1::2]
    loss, stats = linear_cross_entropy_with_stats(
        hidden, weight, labels, reduction=reduction, chunk_size=8, impl="triton", **options
    )
    up = _upstream(loss)
    (loss * up).sum().backward()

    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    z = ref.head_logits(ref_hidden, ref_weight, options.get("softcap"))
    ce_options = {k: v for k, v in options.items() if k != "softcap"}
    expected = ref.cross_entropy(z, labels, reduction=reduction, **ce_options)
    (expected * up).sum().backward()

    assert_close(loss, expected, dtype)
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    assert_close(hidden.grad, ref_hidden.grad, dtype)
    assert_close(weight.grad, ref_weight.grad, dtype)
    expected_stats = ref.token_stats(
        ref.head_logits(hidden.detach(), weight.detach(), options.get("softcap")), labels
    )
    assert torch.equal(stats.correct, expected_stats["correct"]) and stats.correct.any()
    assert torch.equal(stats.valid, expected_stats["valid"])
    assert_close(stats.nll, expected_stats["nll"], dtype)
    assert_close(stats.entropy, expected_stats["entropy"], dtype)


@pytest.mark.parametrize(
    "reduction, options, dtype",
    [("mean", ALL, torch.float32), ("none", {"z_loss": 1e-2}, torch.float32), ("sum", {}, torch.bfloat16)],
)
def test_cross_entropy_from_logits_matches_reference(reduction, options, dtype, monkeypatch):
    monkeypatch.setattr(_triton_kernels, "_MAX_BLOCK", SMALL_BLOCK)
    logits = (
        (3 * torch.randn(N, V, generator=torch.Generator().manual_seed(0))).to(DEVICE, dtype).requires_grad_()
    )
    before = logits.detach().clone()
    labels = make_case(N, H, V)[2].to(DEVICE)
    loss = cross_entropy(logits, labels, reduction=reduction, chunk_size=8, impl="triton", **options)
    up = _upstream(loss)
    (loss * up).sum().backward()

    ref_logits = before.float().requires_grad_()
    ce_options = {k: v for k, v in options.items() if k != "softcap"}
    expected = ref.cross_entropy(
        ref.transform(ref_logits, options.get("softcap")), labels, reduction=reduction, **ce_options
    )
    (expected * up).sum().backward()

    assert_close(loss, expected, dtype)
    assert logits.grad.dtype == dtype
    assert_close(logits.grad, ref_logits.grad, dtype)
    assert torch.equal(logits.detach(), before), "the caller's logits were modified"


@pytest.mark.parametrize(
    "temperature, softcap, with_entropy, dtype",
    [(0.7, 2.0, True, torch.float32), (1.0, None, False, torch.float32), (0.7, 2.0, True, torch.bfloat16)],
)
def test_token_logprobs_matches_reference(temperature, softcap, with_entropy, dtype, monkeypatch):
    monkeypatch.setattr(_triton_kernels, "_MAX_BLOCK", SMALL_BLOCK)
    monkeypatch.setattr(_engine, "_WEIGHT_BLOCK_BYTES", WEIGHT_BLOCK_ROWS * H * 4)
    hidden, weight, labels = _case(dtype)
    function = token_logprobs_with_entropy if with_entropy else token_logprobs
    out = function(
        hidden, weight, labels, temperature=temperature, softcap=softcap, chunk_size=8, impl="triton"
    )
    logprobs, entropy = out if with_entropy else (out, None)
    up = _upstream(logprobs)
    ((logprobs * up).sum() + (entropy.sum() if with_entropy else 0.0)).backward()

    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    exp_lp, exp_ent = ref.logprobs_and_entropy(
        ref.head_logits(ref_hidden, ref_weight, softcap, temperature), labels
    )
    ((exp_lp * up).sum() + (exp_ent.sum() if with_entropy else 0.0)).backward()

    assert_close(logprobs, exp_lp, dtype)
    if with_entropy:
        assert_close(entropy, exp_ent, dtype)
    assert_close(hidden.grad, ref_hidden.grad, dtype)
    assert_close(weight.grad, ref_weight.grad, dtype)


@pytest.mark.parametrize(
    "path, logit_scale, softcap, dtype",
    [
        ("linear", 0.3, None, torch.float32),
        ("linear", 2.5, 4.0, torch.float32),
        ("logprobs", 2.5, 4.0, torch.float32),
        ("linear", 2.5, 4.0, torch.bfloat16),
        ("logprobs", 0.3, None, torch.bfloat16),
    ],
)
def test_head_bias_and_logit_scale_match_reference(path, logit_scale, softcap, dtype, monkeypatch):
    # The logit scale is folded into the row kernels' transform (before the cap) and into the gradient
    # coefficients; the bias enters the chunk's matmul and gets its gradient summed over the chunk's rows.
    monkeypatch.setattr(_triton_kernels, "_MAX_BLOCK", SMALL_BLOCK)
    monkeypatch.setattr(_engine, "_WEIGHT_BLOCK_BYTES", WEIGHT_BLOCK_ROWS * H * 4)
    hidden, weight, labels = _case(dtype)
    bias = make_bias(V, dtype).detach().to(DEVICE).requires_grad_()
    leaves = [hidden, weight, bias]
    ref_leaves = upcast_leaves(*leaves)
    head = {"bias": bias, "logit_scale": logit_scale, "softcap": softcap, "chunk_size": 8, "impl": "triton"}
    up = _upstream(torch.empty(N))
    ref_head = {"bias": ref_leaves[2], "logit_scale": logit_scale}
    if path == "linear":
        out = linear_cross_entropy(hidden, weight, labels, reduction="none", **head)
        expected = ref.cross_entropy(
            ref.head_logits(*ref_leaves[:2], softcap, **ref_head), labels, reduction="none"
        )
    else:
        out = token_logprobs(hidden, weight, labels, temperature=0.7, **head)
        expected, _ = ref.logprobs_and_entropy(
            ref.head_logits(*ref_leaves[:2], softcap, 0.7, **ref_head), labels
        )
    (out * up).sum().backward()
    (expected * up).sum().backward()
    assert_close(out, expected, dtype)
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert leaf.grad.dtype == dtype
        assert_close(leaf.grad, ref_leaf.grad, dtype)


@pytest.mark.parametrize("softcap", _softcap_cases.SOFTCAPS)
@pytest.mark.parametrize("path", _softcap_cases.PATHS)
def test_saturated_softcap_matches_reference(path, softcap, monkeypatch):
    monkeypatch.setattr(_triton_kernels, "_MAX_BLOCK", SMALL_BLOCK)
    _softcap_cases.check_saturated_softcap(path, softcap, "triton", DEVICE)


def test_correct_breaks_ties_to_the_first_maximum_across_tiles(monkeypatch):
    monkeypatch.setattr(_triton_kernels, "_MAX_BLOCK", SMALL_BLOCK)
    logits = torch.zeros(4, 40, device=DEVICE)
    logits[:, 5] = logits[:, 30] = 2.0  # equal maxima in the first and the second tile
    labels = torch.tensor([5, 30, IGNORE, 7], device=DEVICE)
    _, stats = cross_entropy_with_stats(logits, labels, impl="triton")
    assert stats.correct.tolist() == [True, False, False, False]


def test_all_ignored_gives_zero_loss_and_zero_grads():
    hidden, weight, _ = _case()
    labels = torch.full((N,), IGNORE, device=DEVICE)
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8, impl="triton", label_smoothing=0.1)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(
        weight.grad, torch.zeros_like(weight)
    )


@pytest.mark.skipif(not INTERPRET, reason="the gloo workers hold CPU tensors: run in the interpreter")
@pytest.mark.parametrize(
    "path, reduction, options, dtype",
    [
        ("linear", "mean", {}, torch.float32),
        ("linear", "none", ALL, torch.float32),
        ("logits", "none", ALL, torch.float32),
        ("logprobs", None, {"temperature": 0.7}, torch.float32),
        ("linear", "mean", ALL, torch.bfloat16),
        ("linear", "none", {"bias": True, "logit_scale": 0.3, "softcap": 2.0}, torch.float32),
        ("logprobs", None, {"bias": True, "logit_scale": 2.5, "temperature": 0.7}, torch.float32),
    ],
)
def test_tp2_matches_the_single_rank_reference(world2, path, reduction, options, dtype):
    check_against_single_rank_reference(world2, path, "triton", reduction, options, dtype)
