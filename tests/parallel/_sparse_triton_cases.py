"""The Triton kernels of the sparse attention against SDPA under the selection as a mask; run by
``test_sparse_attention.py`` in a fresh process with ``TRITON_INTERPRET=1`` (CPU tensors, as
``tests/ops/_triton_cases.py``), or on CUDA without it."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    raise RuntimeError("Without CUDA these cases need TRITON_INTERPRET=1 from process start.")

pytest.importorskip("triton")

from lightning_cp.parallel import _indexer_triton, _sparse_triton, key_indexer, unshard
from lightning_cp.parallel import sparse_attention as kernel
from lightning_cp.parallel.sparse_attention import sparse_attention
from tests.parallel import test_sparse_attention as cases

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


@pytest.mark.parametrize(
    ("form", "packed", "with_sinks", "wide"),
    [("expanded", False, False, True), ("expanded", True, True, False), ("latent", True, True, True)],
    ids=["expanded-padded-tiles", "expanded-packed-sinks", "latent-packed-sinks-tiles-head-blocks"],
)
def test_the_triton_kernels_match_sdpa_under_the_selection_as_a_mask(
    form, packed, with_sinks, wide, monkeypatch
):
    """``wide``: top-24 keys in tiles of 16 (the last one short, many entries ``-1``) and, for the latent form,
    20 query heads on one key in programs of 16 heads (the last one short)."""
    monkeypatch.setattr(
        kernel, "_kernels", lambda q: (_sparse_triton.forward_round, _sparse_triton.backward_round)
    )
    if wide:
        monkeypatch.setattr(cases, "KERNEL_TOPK", 24)
        monkeypatch.setattr(cases, "FORMS", {**cases.FORMS, "latent": (20, 1)})
        monkeypatch.setattr(_sparse_triton, "KEY_TILE", 16)
        monkeypatch.setattr(_sparse_triton, "HEAD_BLOCK", 16)
    cu = cases.PACKED_CU if packed else None
    batch, total = (1, int(cases.PACKED_CU[-1])) if packed else cases.PADDED_SHAPE
    expected = cases._kernel_reference((form, batch, total), cu, with_sinks)
    q, k, v, dout, sinks = cases._kernel_inputs(form, batch, total)
    local = [None if t is None else cases._shard(t.transpose(1, 2), 1, 0, cu) for t in (q, k, v, dout)]
    shard = local[0][1]
    q, k, v, dout = (None if t is None else t[0].transpose(1, 2).to(DEVICE) for t in local)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks) if t is not None]
    selected = cases._local_selection(shard, cases._documents(batch, total, cu)).to(DEVICE)
    value_dim = cases.VALUE_DIM if v is None else None
    out = sparse_attention(
        q, k, v, selected, shard, cases.DIM**-0.5, sinks if with_sinks else None, value_dim=value_dim
    )
    out.backward(dout)
    got = [out.detach(), *(t.grad for t in leaves[:-1])] + ([None] if v is None else [])
    got.append(sinks.grad if with_sinks else None)
    for name, g, want in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        if want is None:
            continue
        if name != "dsinks":
            g = unshard(
                [g.cpu().transpose(1, 2)], seq_len=None if packed else total, cu_seqlens=cu
            ).transpose(1, 2)
        torch.testing.assert_close(g.cpu(), want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.skipif(INTERPRET, reason="the interpreter's tl.dot of bf16 tiles returns garbage (Triton 3.9)")
@pytest.mark.parametrize("form", ["expanded", "latent"])
def test_in_bf16_the_triton_kernels_are_within_bf16_s_error_of_the_fp32_reference(form):
    """Compiled on CUDA: bf16 inputs (probabilities cast to bf16 before they multiply the values) against the
    fp32 reference, packed, with sinks; outputs and gradients within 2% in norm."""
    cu = cases.PACKED_CU
    expected = cases._kernel_reference((form, 1, int(cu[-1])), cu, True)
    q, k, v, dout, sinks = cases._kernel_inputs(form, 1, int(cu[-1]))
    local = [None if t is None else cases._shard(t.transpose(1, 2), 1, 0, cu) for t in (q, k, v, dout)]
    shard = local[0][1]
    q, k, v, dout = (None if t is None else t[0].transpose(1, 2).to(DEVICE, torch.bfloat16) for t in local)
    sinks = sinks.to(DEVICE)
    leaves = [t.requires_grad_() for t in (q, k, v, sinks) if t is not None]
    selected = cases._local_selection(shard, cases._documents(1, int(cu[-1]), cu)).to(DEVICE)
    value_dim = cases.VALUE_DIM if v is None else None
    out = sparse_attention(q, k, v, selected, shard, cases.DIM**-0.5, sinks, value_dim=value_dim)
    out.backward(dout)
    got = [out.detach(), *(t.grad for t in leaves[:-1])] + ([None] if v is None else []) + [sinks.grad]
    for name, g, want in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        if want is None:
            continue
        if name != "dsinks":
            g = unshard([g.float().cpu().transpose(1, 2)], cu_seqlens=cu).transpose(1, 2)
        assert ((g.float().cpu() - want).norm() / want.norm()).item() < 2e-2, name


@pytest.mark.parametrize("rounding", [None, torch.bfloat16], ids=["fp32", "rounded-as-autocast"])
def test_the_triton_indexer_scores_are_the_fp64_scores_and_round_as_the_torch_path(rounding, monkeypatch):
    """Tiles of 16 queries by 16 keys over a block of 45 queries and 150 keys (the last tiles short, those of the
    first document's queries past its keys skipped), head dim 24 padded to 32. Rounded: on a grid where fp32 is
    exact, equal to the torch path to the last bit (Triton 3.9's interpreter converts fp32 to bf16 by truncation
    where compiled code rounds to nearest: there the torch path truncates alike)."""
    monkeypatch.setattr(_indexer_triton, "QUERY_TILE", 16)
    monkeypatch.setattr(_indexer_triton, "KEY_TILE", 16)
    q, w, k, first, last = cases._score_inputs(grid=rounding is not None)
    got = _indexer_triton.scores(*(t.to(DEVICE) for t in (q, w, k, first, last)), cases.INDEX_SCALE, rounding)
    if rounding is None:
        want = cases._scores_reference(q, w, k, first, last, cases.INDEX_SCALE)
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    else:
        if INTERPRET:
            monkeypatch.setattr(key_indexer, "_rounded", _truncated)
        want = key_indexer._torch_scores(q, w, k, first, last, cases.INDEX_SCALE, rounding)
        assert torch.equal(got.cpu(), want)


def _truncated(x, dtype):
    """``x`` fp32 cut to bf16's 8 bits of mantissa (rounded toward zero), as fp32."""
    return (x.view(torch.int32) & -(2**16)).view(torch.float32)


@pytest.mark.skipif(INTERPRET, reason="the interpreter's tl.dot of bf16 tiles returns garbage (Triton 3.9)")
def test_in_bf16_the_triton_indexer_scores_sum_the_exact_products_in_fp32():
    """Compiled on CUDA: bf16 queries and keys, fp32 weights; every product exact, the sum in fp32: the fp64
    scores of the bf16 values within fp32's error (a score rounded to bf16 would be 0.4% off)."""
    q, w, k, first, last = cases._score_inputs(torch.bfloat16)
    got = _indexer_triton.scores(
        *(t.to(DEVICE) for t in (q, w.float(), k, first, last)), cases.INDEX_SCALE, None
    )
    want = cases._scores_reference(q, w.float(), k, first, last, cases.INDEX_SCALE)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
