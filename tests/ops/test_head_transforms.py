"""The LM head's output transforms on the torch path: ``bias``, ``logit_scale`` and ``softcap`` together.

The reference materializes ``softcap(logit_scale * (hidden @ weight.T + bias)) / temperature`` in fp32 and
takes ``F.cross_entropy`` / ``log_softmax`` of it (``tests/ops/_reference.py``). The Triton kernels run
the same transforms in ``_triton_cases.py``, tensor parallelism in ``test_tensor_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_cp.ops import (
    _engine,
    cross_entropy,
    linear_cross_entropy,
    linear_cross_entropy_with_stats,
    token_logprobs,
    token_logprobs_with_entropy,
)
from tests.ops import _reference as ref
from tests.ops._reference import IGNORE, assert_close, make_bias, make_case, upcast_leaves

N, H, V = 37, 16, 50
# Cohere's logit_scale is 1/16 to 1/8, Granite's logits_scaling 8 to 16 (a scale of 1/8 to 1/16); 0.3 and
# 2.5 move the loss by far more than 1% and keep the softcapped logits off the flat part of tanh.
TRANSFORMS = {
    "bias": {"bias": True},
    "scale": {"logit_scale": 0.3},
    "bias+scale+softcap": {"bias": True, "logit_scale": 2.5, "softcap": 4.0},
}


def _inputs(transform: str, dtype: torch.dtype = torch.float32):
    """``hidden``, ``weight``, ``labels``, the bias (or ``None``) and the other options of ``transform``."""
    hidden, weight, labels = make_case(N, H, V, dtype)
    options = dict(TRANSFORMS[transform])
    bias = make_bias(V, dtype) if options.pop("bias", False) else None
    return hidden, weight, labels, bias, options


def _reference_logits(leaves, options, temperature=1.0):
    hidden, weight, *bias = leaves
    return ref.head_logits(
        hidden,
        weight,
        options.get("softcap"),
        temperature,
        bias=bias[0] if bias else None,
        logit_scale=options.get("logit_scale", 1.0),
    )


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_linear_cross_entropy_applies_the_head_transforms(transform, reduction):
    hidden, weight, labels, bias, options = _inputs(transform)
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    loss, stats = linear_cross_entropy_with_stats(
        hidden, weight, labels, bias=bias, reduction=reduction, chunk_size=8, impl="torch", **options
    )
    up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)) if loss.dim() else 0.7
    (loss * up).sum().backward()

    ref_leaves = upcast_leaves(*leaves)
    z = _reference_logits(ref_leaves, options)
    expected = ref.cross_entropy(z, labels, reduction=reduction)
    (expected * up).sum().backward()

    assert_close(loss, expected)
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert_close(leaf.grad, ref_leaf.grad)
    reference_stats = ref.token_stats(z, labels)
    assert torch.equal(stats.correct, reference_stats["correct"])
    assert_close(stats.entropy, reference_stats["entropy"])


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_token_logprobs_apply_the_head_transforms_before_the_temperature(transform):
    hidden, weight, labels, bias, options = _inputs(transform)
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    logprobs, entropy = token_logprobs_with_entropy(
        hidden, weight, labels, bias=bias, temperature=0.7, chunk_size=8, impl="torch", **options
    )
    up = torch.randn(N, generator=torch.Generator().manual_seed(1))
    ((logprobs * up).sum() + 0.5 * entropy.sum()).backward()

    ref_leaves = upcast_leaves(*leaves)
    exp_lp, exp_ent = ref.logprobs_and_entropy(_reference_logits(ref_leaves, options, 0.7), labels)
    ((exp_lp * up).sum() + 0.5 * exp_ent.sum()).backward()

    assert_close(logprobs, exp_lp)
    assert_close(entropy, exp_ent)
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert_close(leaf.grad, ref_leaf.grad)


def test_cross_entropy_from_logits_applies_the_logit_scale():
    logits = (3 * torch.randn(N, V, generator=torch.Generator().manual_seed(0))).requires_grad_()
    labels = make_case(N, H, V)[2]
    loss = cross_entropy(logits, labels, logit_scale=0.3, softcap=2.0, chunk_size=8, impl="torch")
    loss.backward()
    ref_logits = logits.detach().clone().requires_grad_()
    expected = ref.cross_entropy(ref.transform(ref_logits, 2.0, logit_scale=0.3), labels)
    expected.backward()
    assert_close(loss, expected)
    assert_close(logits.grad, ref_logits.grad)


@pytest.mark.parametrize("path", ["linear", "logprobs"])
def test_bf16_bias_gradient_is_summed_in_fp32_beside_the_vocabulary_block_pass(monkeypatch, path):
    # The bf16 weight's gradient comes from the vocabulary-block pass (3-row blocks here); its blocks'
    # logits need the bias too, and the bias gradient, summed over 37 tokens, is rounded once.
    monkeypatch.setattr(_engine, "_WEIGHT_BLOCK_BYTES", 3 * H * 4)
    hidden, weight, labels, bias, options = _inputs("bias+scale+softcap", torch.bfloat16)
    leaves = [hidden, weight, bias]
    ref_leaves = upcast_leaves(*leaves)
    if path == "linear":
        linear_cross_entropy(
            hidden, weight, labels, bias=bias, chunk_size=8, impl="torch", **options
        ).backward()
        ref.cross_entropy(_reference_logits(ref_leaves, options), labels).backward()
    else:
        up = torch.randn(N, generator=torch.Generator().manual_seed(1))
        (
            token_logprobs(hidden, weight, labels, bias=bias, chunk_size=8, impl="torch", **options) * up
        ).sum().backward()
        exp_lp, _ = ref.logprobs_and_entropy(_reference_logits(ref_leaves, options), labels)
        (exp_lp * up).sum().backward()
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert leaf.grad.dtype == torch.bfloat16
        assert_close(leaf.grad, ref_leaf.grad, torch.bfloat16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_trainable_bias_alone_gets_its_gradient(reduction):
    hidden, weight, labels, bias, options = _inputs("bias+scale+softcap")
    hidden.requires_grad_(False)
    weight.requires_grad_(False)
    loss = linear_cross_entropy(
        hidden, weight, labels, bias=bias, reduction=reduction, chunk_size=8, impl="torch", **options
    )
    loss.sum().backward()
    ref_bias = bias.detach().clone().requires_grad_()
    z = _reference_logits([hidden, weight, ref_bias], options)
    ref.cross_entropy(z, labels, reduction=reduction).sum().backward()
    assert hidden.grad is None and weight.grad is None
    assert_close(bias.grad, ref_bias.grad)


def test_ignored_tokens_add_nothing_to_the_bias_gradient():
    hidden, weight, _, bias, _ = _inputs("bias")
    linear_cross_entropy(hidden, weight, torch.full((N,), IGNORE), bias=bias, impl="torch").backward()
    assert torch.equal(bias.grad, torch.zeros_like(bias))


def _bad_call(kind: str):
    hidden, weight, labels = make_case(N, H, V)
    if kind == "bias shape":
        linear_cross_entropy(hidden, weight, labels, bias=torch.zeros(V + 1))
    elif kind == "bias dtype":
        linear_cross_entropy(hidden, weight, labels, bias=torch.zeros(V, dtype=torch.float64))
    elif kind == "bias type":
        token_logprobs(hidden, weight, labels, bias=[0.0] * V)
    elif kind == "zero scale":
        linear_cross_entropy(hidden, weight, labels, logit_scale=0.0)
    elif kind == "nan scale":
        token_logprobs(hidden, weight, labels, logit_scale=float("nan"))
    elif kind == "bool scale":
        cross_entropy(hidden @ weight.t(), labels, logit_scale=True)


@pytest.mark.parametrize(
    "kind, error, match",
    [
        ("bias shape", ValueError, r"`bias` must have shape \(50,\)"),
        ("bias dtype", ValueError, "cast the head's bias like its weight"),
        ("bias type", TypeError, "`bias` must be a torch.Tensor or None"),
        ("zero scale", ValueError, "`logit_scale` must be a positive finite number"),
        ("nan scale", ValueError, "logit_scale=1 / d"),
        ("bool scale", ValueError, "got True"),
    ],
)
def test_bad_transforms_raise_early_with_a_clear_message(kind, error, match):
    with pytest.raises(error, match=match):
        _bad_call(kind)
