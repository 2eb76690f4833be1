"""Vocabulary-parallel cases shared by ``test_tensor_parallel.py`` (torch) and ``_triton_cases.py`` (Triton).

Every rank builds the same full problem from a seed and keeps its Megatron vocabulary shard
``weight[r * V / 2 : (r + 1) * V / 2]`` (and the same rows of the LM-head bias when the options ask for
one with ``"bias": True``); labels are global ids, so about half of each rank's targets live on the
other rank.
"""

from __future__ import annotations

import torch

from lightning_cp.ops import (
    cross_entropy,
    linear_cross_entropy_with_stats,
    token_logprobs_with_entropy,
)
from lightning_cp.parallel import groups
from tests._dist import WorkerPool
from tests.ops import _reference as ref
from tests.ops._reference import assert_close, make_bias, make_case, upcast_leaves

N, H, V = 37, 16, 50
TP = 2
SHARD = V // TP


def upstream(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """An upstream gradient, identical on every rank (the loss is replicated over the TP group)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) if shape else torch.tensor(0.7)


def run_sharded(
    path: str, impl: str, reduction: str | None, options: dict, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """On every rank: one loss path on this rank's vocabulary shard, forward and backward."""
    layout = groups.initialize(tp=TP, cp=1)
    group, rank = layout.tp_group, layout.tp_rank
    options = dict(options)
    hidden, weight, labels = make_case(N, H, V, dtype)
    hidden = hidden.detach().requires_grad_()
    rows = slice(rank * SHARD, (rank + 1) * SHARD)
    shard = weight.detach()[rows].clone().requires_grad_()
    bias = make_bias(V, dtype).detach()[rows].clone().requires_grad_() if options.pop("bias", False) else None
    common = {"tp_group": group, "chunk_size": 8, "impl": impl}
    if path == "linear":
        loss, stats = linear_cross_entropy_with_stats(
            hidden, shard, labels, bias=bias, reduction=reduction, **common, **options
        )
        (loss * upstream(loss.shape, 1)).sum().backward()
        return {
            "loss": loss.detach(),
            "grad_hidden": hidden.grad,
            "grad_shard": shard.grad,
            "grad_bias_shard": None if bias is None else bias.grad,
            "nll": stats.nll,
            "entropy": stats.entropy,
            "correct": stats.correct,
        }
    if path == "logits":
        logits = (hidden @ shard.t()).detach().requires_grad_()
        loss = cross_entropy(logits, labels, reduction=reduction, **common, **options)
        (loss * upstream(loss.shape, 1)).sum().backward()
        return {"loss": loss.detach(), "grad_logits_shard": logits.grad}
    logprobs, entropy = token_logprobs_with_entropy(hidden, shard, labels, bias=bias, **common, **options)
    ((logprobs * upstream((N,), 1)).sum() + (entropy * upstream((N,), 2)).sum()).backward()
    return {
        "logprobs": logprobs.detach(),
        "entropy": entropy.detach(),
        "grad_hidden": hidden.grad,
        "grad_shard": shard.grad,
        "grad_bias_shard": None if bias is None else bias.grad,
    }


def check_against_single_rank_reference(
    world: WorkerPool,
    path: str,
    impl: str,
    reduction: str | None,
    options: dict,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Run :func:`run_sharded` on ``world`` (2 ranks) and compare every rank with the unsharded fp32
    reference; ``dtype`` is the dtype of the inputs."""
    results = world.run(run_sharded, path, impl, reduction, options, dtype)

    hidden, weight, labels = make_case(N, H, V, dtype)
    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    (ref_bias,) = upcast_leaves(make_bias(V, dtype)) if options.get("bias") else (None,)
    softcap = options.get("softcap")
    head = {"bias": ref_bias, "logit_scale": options.get("logit_scale", 1.0)}
    expected: dict[str, torch.Tensor] = {}
    if path == "logprobs":
        z = ref.head_logits(ref_hidden, ref_weight, softcap, options.get("temperature", 1.0), **head)
        expected["logprobs"], expected["entropy"] = ref.logprobs_and_entropy(z, labels)
        (
            (expected["logprobs"] * upstream((N,), 1)).sum() + (expected["entropy"] * upstream((N,), 2)).sum()
        ).backward()
    else:
        if path == "logits":
            logits = ref.head_logits(hidden.detach(), weight.detach()).requires_grad_()
            z = ref.transform(logits, softcap, logit_scale=head["logit_scale"])
        else:
            z = ref.head_logits(ref_hidden, ref_weight, softcap, **head)
            expected.update((k, v) for k, v in ref.token_stats(z, labels).items() if k != "valid")
        ce_options = {k: v for k, v in options.items() if k in ("label_smoothing", "z_loss")}
        expected["loss"] = ref.cross_entropy(z, labels, reduction=reduction, **ce_options)
        (expected["loss"] * upstream(expected["loss"].shape, 1)).sum().backward()
        if path == "logits":
            expected["grad_logits"] = logits.grad

    for rank, got in enumerate(results):
        rows = slice(rank * SHARD, (rank + 1) * SHARD)
        for name in ("loss", "logprobs", "entropy", "nll"):
            if name in got:
                assert_close(got[name], expected[name], dtype)
        if "correct" in got:
            assert torch.equal(got["correct"], expected["correct"])
        if path == "logits":
            assert_close(got["grad_logits_shard"], expected["grad_logits"][:, rows], dtype)
        else:
            assert_close(got["grad_hidden"], ref_hidden.grad, dtype)  # the full gradient, on every rank
            assert_close(got["grad_shard"], ref_weight.grad[rows], dtype)
            if ref_bias is not None:
                assert_close(got["grad_bias_shard"], ref_bias.grad[rows], dtype)
