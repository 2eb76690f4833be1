"""CP attention in low precision: one compute dtype under autocast, the kernel chooser's CUDA decisions.

The CUDA kernels cannot run here: the chooser (:func:`~lightning_cp.parallel._varlen.flash_chosen`) is
asked what it would do on a CUDA device, and mixed precision runs under CPU autocast, against the same
attention of consistent bf16 inputs.
"""

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from lightning_cp.parallel import _varlen, context_parallel_attention, groups, unshard
from tests.parallel._collectives import recorded_collectives
from tests.parallel._fake_flash import fake_flash
from tests.parallel.test_attention import PADDED_SHAPE, _inputs, _reference, _shard_heads

BF16 = torch.bfloat16


def _autocast_vs_consistent_bf16():
    """cp = 2: q, k fp32 and v bf16 under bf16 autocast (mixed precision's fp32 rotary tables), and the
    same values all bf16 without autocast."""
    layout = groups.initialize(tp=1, cp=2)
    rank = layout.cp_rank
    q, k, v, dout = (_shard_heads(t.to(BF16), 2, rank, None, layout.cp_group) for t in _inputs(*PADDED_SHAPE))
    shard = q[1]
    consistent = [t[0].clone().requires_grad_() for t in (q, k, v)]
    mixed = [q[0].float().requires_grad_(), k[0].float().requires_grad_(), v[0].clone().requires_grad_()]
    out = context_parallel_attention(*consistent, cp_shard=shard)
    out.backward(dout[0])
    with recorded_collectives() as calls, torch.autocast("cpu", dtype=BF16):
        mixed_out = context_parallel_attention(*mixed, cp_shard=shard)
    mixed_out.backward(dout[0])
    gathered = {call.dtype for call in calls if call.kind == "all_gather"}
    return mixed_out.detach(), out.detach(), [t.grad for t in mixed], [t.grad for t in consistent], gathered


def test_mixed_precision_inputs_compute_as_consistent_bf16(world2):
    """Under autocast q, k, v are cast to bf16 before the kernel choice and the exchange: the output and
    the gradients are those of bf16 inputs (the kernel's forward not in autocast's dtype and its backward
    in fp32), and the all-gather moves bf16."""
    for mixed_out, out, mixed_grads, grads, gathered in world2.run(_autocast_vs_consistent_bf16):
        assert mixed_out.dtype == BF16 and torch.equal(mixed_out, out)
        for name, mixed_grad, grad in zip("qkv", mixed_grads, grads, strict=True):
            assert torch.equal(mixed_grad, grad.to(mixed_grad.dtype)), name
        assert gathered == {BF16}


def test_the_chooser_takes_flash_on_cuda_only_for_one_low_precision_dtype(monkeypatch, caplog):
    _varlen._log_once.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger=_varlen.__name__):
        assert _varlen.flash_chosen(cuda, (BF16,) * 3, 64, None)
        assert not _varlen.flash_chosen(cuda, (torch.float32, torch.float32, BF16), 64, None)
    assert [r.getMessage() for r in caplog.records] == [
        "CP attention: FlashAttention-2 varlen kernels (CUDA).",
        (
            "CP attention: the exact blocked torch kernel, for q, k, v of different dtypes torch.float32, "
            "torch.float32, torch.bfloat16 (FlashAttention-2 takes one)."
        ),
    ]


def test_a_gpu_older_than_ampere_runs_the_torch_kernel_and_says_so_once(monkeypatch, caplog):
    """FlashAttention-2 needs compute capability 8.0: a V100 (7.0) or a T4 (7.5) would crash in it."""
    _varlen._log_once.cache_clear()
    capability = {"now": (7, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger=_varlen.__name__):
        for _ in range(3):
            assert not _varlen.flash_chosen(cuda, (BF16,) * 3, 64, None)
        capability["now"] = (7, 5)
        assert not _varlen.flash_chosen(cuda, (torch.float16,) * 3, 128, None)
        capability["now"] = (8, 0)  # an A100
        assert _varlen.flash_chosen(cuda, (torch.float16,) * 3, 128, None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "CP attention: the exact blocked torch kernel (fp32 scores, slower than FlashAttention), for a GPU "
        f"of compute capability {version}: FlashAttention-2 needs 8.0 or newer (A100, H100)."
        for version in ("7.0", "7.5")
    ]


def test_a_softcap_keeps_flash_out_even_where_it_would_run_and_says_so_once(monkeypatch, caplog):
    """PyTorch's FlashAttention-2 kernels have no softcap: inputs that take them otherwise (an H100, bf16,
    head dim 64) run the exact torch kernel when the attention caps its logits, asked as the attention asks
    (:func:`~lightning_cp.parallel._varlen.use_flash` of its q, k, v)."""
    _varlen._log_once.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    on_cuda = SimpleNamespace(device=torch.device("cuda", 0), dtype=BF16, shape=(10, 4, 64))
    with caplog.at_level(logging.INFO, logger=_varlen.__name__):
        assert _varlen.use_flash(on_cuda, on_cuda, on_cuda, None)
        for softcap in (50.0, 30.0):
            assert not _varlen.use_flash(on_cuda, on_cuda, on_cuda, softcap)
    warning = (
        "CP attention: attention logit softcapping runs in the exact blocked torch kernel (fp32 scores, "
        "slower than FlashAttention): PyTorch's FlashAttention-2 kernels have no softcap."
    )
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [warning]


def test_under_autocast_the_chooser_is_asked_about_one_dtype(monkeypatch):
    asked = []
    monkeypatch.setattr(_varlen, "flash_chosen", lambda *args: asked.append(args[1]) or False)
    q, k, v, _ = _inputs(1, 10)
    (q, shard), (k, _), (v, _) = (_shard_heads(t, 1, 0, torch.tensor([0, 4, 10])) for t in (q, k, v))
    with torch.autocast("cpu", dtype=BF16):
        context_parallel_attention(q.float(), k.float(), v.to(BF16), cp_shard=shard)
    assert asked == [(BF16,) * 3]


LONG_SHAPE = (2, 96)  # chunks of 12 tokens at cp = 4: each key's gradient summed over up to 4 ranks


def _bf16_key_gradients(flash):
    """cp = 4, bf16 inputs: this rank's dk, dv (blocked kernel, or the FlashAttention path through CPU
    stand-ins) and the dtypes of what the reduce-scatter summed."""
    layout = groups.initialize(tp=1, cp=4)
    rank = layout.cp_rank
    q, k, v, dout = (
        _shard_heads(t.to(BF16), 4, rank, None, layout.cp_group if i == 0 else None)
        for i, t in enumerate(_inputs(*LONG_SHAPE))
    )
    shard = q[1]
    leaves = [t[0].requires_grad_() for t in (q, k, v)]
    with fake_flash() if flash else contextlib.nullcontext(), recorded_collectives() as calls:
        context_parallel_attention(*leaves, cp_shard=shard).backward(dout[0])
    summed = frozenset(call.dtype for call in calls if call.kind == "reduce_scatter")
    return rank, leaves[1].grad, leaves[2].grad, summed


# Relative error of bf16 dk, dv against float64 attention of the same bf16 inputs, measured: summed in
# fp32, 1.9e-3 / 1.6e-3 (blocked kernel) and 2.6e-3 / 2.3e-3 (FlashAttention, whose per-call gradients are
# bf16); summed in bf16 (over the calls and in the reduce-scatter), 3.0e-3 / 2.8e-3 and 3.6e-3 / 3.4e-3.
KEY_GRADIENT_ERROR = {False: 2.4e-3, True: 3.0e-3}


@pytest.mark.parametrize("flash", [False, True], ids=["blocked", "flash"])
def test_key_gradients_are_summed_in_fp32_over_pieces_and_ranks(world4, flash):
    """Each key's gradient is a sum over the pieces and ranks whose queries read it: summed in fp32 (the
    reduce-scatter too) and rounded to bf16 once."""
    by_rank = {rank: (dk, dv, summed) for rank, dk, dv, summed in world4.run(_bf16_key_gradients, flash)}
    assert {by_rank[r][2] for r in range(4)} == {frozenset({torch.float32})}
    expected = _reference(*(t.to(BF16).double() for t in _inputs(*LONG_SHAPE)), None)
    for index, name in ((0, "dk"), (1, "dv")):
        shards = [by_rank[r][index].transpose(1, 2) for r in range(4)]
        got = unshard(shards, seq_len=LONG_SHAPE[1]).transpose(1, 2)
        assert got.dtype == BF16
        want = expected[2 + index]
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error < KEY_GRADIENT_ERROR[flash], f"{name}: {error:.2e}"
