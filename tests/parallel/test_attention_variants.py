"""CP attention variants against an eager softmax on the full sequence, for cp = 1, 2, 4 on 4 gloo ranks.

Variants: sliding window (``transformers``' semantics), attention logit softcapping (Gemma-2), an explicit
``scale``, attention sinks (gpt-oss) and a value head dim other than the query's (DeepSeek's MLA), alone
and combined, padded and packed, with grouped-query attention. The reference is independent of the code
under test: float64 scores of every query against every key of the whole sequence, an explicit boolean
mask built from document ids and positions, softcapping as in ``modeling_gemma2.eager_attention_forward``
and sinks as an extra softmax column as in ``modeling_gpt_oss.eager_attention_forward``; autograd gives its
gradients.
"""

import contextlib
import logging
import math
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from lightning_cp.parallel import CPShard, CPSplit, _varlen, context_parallel_attention, groups, unshard
from lightning_cp.parallel.attention_mode import AttentionMode
from tests.parallel._fake_flash import fake_flash
from tests.parallel.test_attention import _shard_heads

HEADS, KV_HEADS, DIM = 4, 2, 8
PADDED_SHAPE = (2, 22)  # B, S: chunks of 3 / 6 / 11 tokens at cp = 4 / 2 / 1
# Documents of length 1, shorter and longer than every window, and one of 41 (chunks of 6 / 11 / 21).
PACKED_LENGTHS = (1, 9, 1, 41, 7, 2, 3)
TINY_BUDGET = 4 * HEADS * 12  # 12 fp32 scores per head and block: blocks of 1 to 3 queries


@dataclass(frozen=True)
class Variant:
    window: int | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: bool = False
    value_dim: int = DIM
    logit_gain: float = 1.0
    """Queries are multiplied by it: large logits saturate the softcap."""

    def __str__(self) -> str:
        fields = {k: v for k, v in vars(self).items() if v != Variant.__dataclass_fields__[k].default}
        return ",".join(f"{k}={v}" for k, v in fields.items()) or "causal"

    def kwargs(self, sinks):
        return {"window": self.window, "softcap": self.softcap, "scale": self.scale, "sinks": sinks}


VARIANTS = (
    Variant(window=1),
    Variant(window=3),  # inside one chunk
    Variant(window=8),  # across chunk boundaries at cp = 2, 4; longer than most documents
    Variant(window=30),  # several chunks
    Variant(scale=0.9),
    Variant(softcap=2.0),
    Variant(softcap=1.0, logit_gain=20.0),  # |logits| >> softcap: tanh saturates
    Variant(softcap=3.0, window=5, scale=0.2),
    Variant(sinks=True),
    Variant(sinks=True, window=4),
    Variant(value_dim=5),
    Variant(value_dim=12, window=6, sinks=True, softcap=4.0, scale=0.5),
)


def _inputs(batch, total, variant, dtype=torch.float64):
    g = torch.Generator().manual_seed(99)
    q = torch.randn(batch, HEADS, total, DIM, generator=g, dtype=dtype) * variant.logit_gain
    k = torch.randn(batch, KV_HEADS, total, DIM, generator=g, dtype=dtype)
    v = torch.randn(batch, KV_HEADS, total, variant.value_dim, generator=g, dtype=dtype)
    dout = torch.randn(batch, HEADS, total, variant.value_dim, generator=g, dtype=dtype)
    # One dominant sink (most of the softmax mass) among ordinary ones.
    sinks = torch.tensor([0.3, -1.2, 4.0, 1.1], dtype=dtype) if variant.sinks else None
    return q, k, v, sinks, dout


def _reference(q, k, v, sinks, dout, lengths, variant):
    """Eager float64 attention of every row over its documents of ``lengths``: (out, dq, dk, dv, dsinks)."""
    q, k, v = (t.double().clone().requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.double().clone().requires_grad_()
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.cat([torch.arange(n) for n in lengths])
    visible = (document[:, None] == document[None]) & (position[None] <= position[:, None])
    if variant.window is not None:
        visible &= position[None] > position[:, None] - variant.window
    group = HEADS // KV_HEADS
    k_full, v_full = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = DIM**-0.5 if variant.scale is None else variant.scale
    scores = q @ k_full.transpose(-1, -2) * scale
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    out = probs @ v_full
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad, None if sinks is None else sinks.grad


def _problem(packed, rows=PADDED_SHAPE[0]):
    """(batch rows, total tokens, cu_seqlens or None, document lengths of a row)."""
    if packed:
        cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()])
        return 1, int(cu[-1]), cu, list(PACKED_LENGTHS)
    total = PADDED_SHAPE[1]
    return rows, total, None, [total]


@contextlib.contextmanager
def _score_budget(budget):
    saved = _varlen.SCORE_BLOCK_BYTES
    _varlen.SCORE_BLOCK_BYTES = budget or saved
    try:
        yield
    finally:
        _varlen.SCORE_BLOCK_BYTES = saved


def _run_variants(packed, budget, rows=PADDED_SHAPE[0], flash=False, mode=None):
    """On every rank, for cp in (1, 2, 4) and every variant: this rank's output and gradients (``flash``:
    through the FlashAttention-2 path, its kernels replaced by ``_fake_flash``'s CPU stand-ins; ``mode``:
    the shard's :class:`AttentionMode`)."""
    rows, total, cu, _ = _problem(packed, rows)
    results = {}
    with _score_budget(budget), fake_flash() if flash else contextlib.nullcontext():
        for cp in (1, 2, 4):
            layout = groups.initialize(tp=1, cp=cp)
            for index, variant in enumerate(VARIANTS):
                q, k, v, sinks, dout = _inputs(rows, total, variant)
                lq, shard = _shard_heads(q, cp, layout.cp_rank, cu, layout.cp_group, mode)
                lk, lv, ldout = (_shard_heads(t, cp, layout.cp_rank, cu)[0] for t in (k, v, dout))
                leaves = [t.requires_grad_() for t in (lq, lk, lv)]
                ls = None if sinks is None else sinks.clone().requires_grad_()
                out = context_parallel_attention(*leaves, cp_shard=shard, **variant.kwargs(ls))
                out.backward(ldout)
                grads = [t.grad for t in leaves]
                results[cp, index] = (layout.cp_rank, out.detach(), *grads, None if ls is None else ls.grad)
            groups.destroy()
    return results


_ONE_HEAD_PER_GATHER = AttentionMode("allgather", kv_heads_per_gather=1)
KERNELS = {
    "one-block": {"budget": None},
    "many-blocks": {"budget": TINY_BUDGET},
    "flash": {"budget": None, "flash": True},
    "flash-one-row": {"budget": None, "flash": True, "rows": 1},
    "gather-by-head": {"budget": None, "mode": _ONE_HEAD_PER_GATHER},
    "flash-gather-by-head": {"budget": None, "flash": True, "mode": _ONE_HEAD_PER_GATHER},
    "ulysses": {"budget": TINY_BUDGET, "mode": AttentionMode("ulysses")},
    "flash-ulysses": {"budget": None, "flash": True, "mode": AttentionMode("ulysses")},
}
"""The blocked kernel with one or many score blocks per piece; the FlashAttention-2 path (one varlen call
per kept chunk, keys in place or copied per call) with padded rows, packed documents and one sequence;
the all-gather one key/value head at a time; Ulysses (at cp = 4 each rank's query head reads one of the two
key/value heads, replicated on two ranks)."""


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cp_attention_variants_match_full_sequence_eager_attention(world4, packed, kernel):
    if packed and "rows" in KERNELS[kernel]:
        pytest.skip("a packed batch is one row")
    options = KERNELS[kernel]
    per_rank = world4.run(_run_variants, packed, **options)
    rows, total, cu, lengths = _problem(packed, options.get("rows", PADDED_SHAPE[0]))
    for index, variant in enumerate(VARIANTS):
        q, k, v, sinks, dout = _inputs(rows, total, variant)
        expected = _reference(q, k, v, sinks, dout, lengths, variant)
        for cp in (1, 2, 4):
            by_cp_rank = {}
            for results in per_rank:
                rank, *tensors = results[cp, index]
                by_cp_rank.setdefault(rank, tensors)  # DP replicas hold the same shard
            for i, name in enumerate(("out", "dq", "dk", "dv")):
                shards = [by_cp_rank[r][i].transpose(1, 2) for r in range(cp)]
                full = unshard(shards, seq_len=None if packed else total, cu_seqlens=cu).transpose(1, 2)
                torch.testing.assert_close(
                    full, expected[i], rtol=1e-9, atol=1e-10, msg=f"{variant} cp={cp} {name}"
                )
            if variant.sinks:  # each rank's share is over its own queries; DDP sums them
                dsinks = sum(by_cp_rank[r][4] for r in range(cp))
                torch.testing.assert_close(
                    dsinks, expected[4], rtol=1e-9, atol=1e-10, msg=f"{variant} cp={cp}"
                )


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_without_a_shard_every_row_is_one_sequence(variant):
    """No CP, no shard: rows of an odd length (no padding possible) through the same kernels."""
    q, k, v, sinks, dout = _inputs(3, 13, variant)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ls = None if sinks is None else sinks.clone().requires_grad_()
    out = context_parallel_attention(*leaves, **variant.kwargs(ls))
    out.backward(dout)
    got = (out, *(t.grad for t in leaves), None if ls is None else ls.grad)
    for name, a, b in zip(
        ("out", "dq", "dk", "dv", "dsinks"), got, _reference(q, k, v, sinks, dout, [13], variant)
    ):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=f"{variant} {name}")


def test_fp32_inputs_match_the_float64_reference():
    """fp32 through the blocked kernel (fp32 scores), every variant at once, packed, several blocks."""
    variant = VARIANTS[-1]
    rows, total, cu, lengths = _problem(packed=True)
    q, k, v, sinks, dout = _inputs(rows, total, variant, dtype=torch.float32)
    (lq, shard), (lk, _), (lv, _), (ldout, _) = (_shard_heads(t, 1, 0, cu) for t in (q, k, v, dout))
    leaves = [t.requires_grad_() for t in (lq, lk, lv)]
    ls = sinks.clone().requires_grad_()
    with _score_budget(TINY_BUDGET):
        out = context_parallel_attention(*leaves, cp_shard=shard, **variant.kwargs(ls))
        out.backward(ldout)
    expected = _reference(q, k, v, sinks, dout, lengths, variant)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), expected):
        full = unshard([got.transpose(1, 2)], cu_seqlens=cu).transpose(1, 2)
        torch.testing.assert_close(full.double(), want, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(ls.grad.double(), expected[4], rtol=1e-5, atol=1e-5)


def test_the_eager_reference_window_is_sdpa_with_transformers_sliding_window_mask():
    """The reference itself: its window equals SDPA with the mask of ``masking_utils`` (causal and
    ``kv_idx > q_idx - sliding_window``)."""
    variant = Variant(window=4)
    q, k, v, _, dout = _inputs(1, 17, variant)
    position = torch.arange(17)
    mask = (position[None] <= position[:, None]) & (position[None] > position[:, None] - 4)
    group = HEADS // KV_HEADS
    sdpa = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask
    )
    torch.testing.assert_close(_reference(q, k, v, None, dout, [17], variant)[0], sdpa)


def test_blocks_respect_the_score_budget_and_cover_every_visible_key(monkeypatch):
    monkeypatch.setattr(_varlen, "SCORE_BLOCK_BYTES", 4 * HEADS * 40)
    pieces = [(0, 7, 0, 7), (7, 12, 7, 30), (12, 13, 30, 51), (13, 40, 51, 78)]
    for window in (None, 1, 3, 6, 25):
        covered = set()
        for q0, q1, k0, k1, diagonal in _varlen._blocks(pieces, HEADS, window):
            rows, keys = q1 - q0, k1 - k0
            assert rows == 1 or rows * keys <= 40, (window, q0, q1, k0, k1)
            piece = next(p for p in pieces if p[0] <= q0 < p[1])
            lq, lk = piece[1] - piece[0], piece[3] - piece[2]
            for j in range(q0 - piece[0], q1 - piece[0]):
                last = lk - lq + j  # the key on the query's diagonal, within its piece
                seen = range(0 if window is None else max(0, last - window + 1), last + 1)
                assert all(k0 <= piece[2] + m < k1 for m in seen), (window, j)
                # the block's diagonal argument names that key for the block's first query
                assert j > q0 - piece[0] or piece[2] + last == k0 + diagonal
                covered.add(piece[0] + j)
        assert covered == set(range(40))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0}, "window=0 must be a positive integer"),
        ({"window": -3}, "window=-3"),
        ({"window": 2.5}, "window=2.5"),
        ({"window": True}, "window=True"),
        ({"softcap": 0.0}, "softcap=0.0 must be a positive finite number"),
        ({"softcap": -30.0}, "softcap=-30.0"),
        ({"softcap": math.inf}, "softcap=inf"),
        ({"scale": 0.0}, "scale=0.0 must be a positive finite number"),
        ({"scale": math.nan}, "scale=nan"),
        ({"sinks": torch.zeros(KV_HEADS)}, r"sinks must be a float tensor \[Hq\] = \[4\].*got \(2,\)"),
        ({"sinks": torch.zeros(1, HEADS)}, r"got \(1, 4\)"),
        ({"sinks": torch.zeros(HEADS, dtype=torch.long)}, "torch.int64"),
        ({"sinks": [0.0] * HEADS}, r"got \[0.0"),
    ],
)
def test_bad_variant_arguments_are_refused_with_what_to_pass(kwargs, match):
    q, k, v, _, _ = _inputs(1, 6, Variant())
    with pytest.raises(ValueError, match=match):
        context_parallel_attention(q, k, v, **kwargs)


def test_value_head_dim_may_differ_but_not_the_key_head_dim():
    q = torch.randn(1, HEADS, 6, DIM)
    with pytest.raises(ValueError, match="k the same D"):
        context_parallel_attention(q, torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))
    with pytest.raises(ValueError, match=r"v \[B, Hkv, S_local, Dv\]"):
        context_parallel_attention(q, torch.randn(1, 2, 6, DIM), torch.randn(1, 1, 6, DIM))
    assert context_parallel_attention(q, q[:, :2], torch.randn(1, 2, 6, 3)).shape == (1, HEADS, 6, 3)


def test_the_kernel_in_use_is_logged_once(caplog):
    _varlen._log_once.cache_clear()
    q = torch.randn(1, HEADS, 6, DIM)
    shard = CPShard.build(CPSplit(1, 0), torch.tensor([6]), "cpu")
    with caplog.at_level(logging.INFO, logger=_varlen.__name__):
        for _ in range(3):
            context_parallel_attention(q, q[:, :2], q[:, :2], cp_shard=shard, window=2)
    assert [r.getMessage() for r in caplog.records] == [
        "CP attention: the exact blocked torch kernel, for cpu tensors (FlashAttention-2 is CUDA only)."
    ]


_LONG_VARIANTS = """
import resource, torch
from lightning_cp.parallel import context_parallel_attention, shard_batch
total = 32768
cu = torch.tensor([0, 1, 4097, 8190, 12285, 16384, 20479, 24576, 28671, total])
batch = shard_batch({"input_ids": torch.zeros(1, total, dtype=torch.long), "cu_seqlens": cu}, 1, 0)
g = torch.Generator().manual_seed(0)
local = batch["cp_shard"].local_tokens
q, k = (torch.randn(1, 1, local, 16, generator=g).requires_grad_() for _ in range(2))
v = torch.randn(1, 1, local, 8, generator=g).requires_grad_()
sinks = torch.zeros(1, requires_grad=True)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for window in (None, 1000):
    out = context_parallel_attention(q, k, v, cp_shard=batch["cp_shard"], window=window, softcap=5.0, sinks=sinks)
    out.sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_every_variant_keeps_the_blocked_kernel_memory_bound():
    """Softcap, sinks, a value head dim of its own, with and without a window, on 32K packed tokens: a
    [T, T] boolean mask alone would be 1 GiB; the blocked kernel keeps a few 64 MiB blocks at a time."""
    result = subprocess.run(
        [sys.executable, "-c", _LONG_VARIANTS], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    growth = int(result.stdout.strip().splitlines()[-1])
    assert growth < 400 * 2**20, f"peak RSS grew {growth / 2**20:.0f} MiB"


def _cuda_bf16_run(variant, lengths):
    """Packed documents of ``lengths`` at cp = 1 on CUDA in bf16 (fp32 sinks): (whether FlashAttention ran,
    the float64 inputs, the outputs and gradients)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, sinks, dout = _inputs(1, int(cu[-1]), variant)
    (lq, _), (lk, _), (lv, _), (ldout, _) = (_shard_heads(t, 1, 0, cu) for t in (q, k, v, dout))
    shard = CPShard.build(CPSplit(1, 0), torch.tensor(lengths), "cuda")
    leaves = [t.cuda().bfloat16().requires_grad_() for t in (lq, lk, lv)]
    ls = None if sinks is None else sinks.cuda().float().requires_grad_()
    out = context_parallel_attention(*leaves, cp_shard=shard, **variant.kwargs(ls))
    out.backward(ldout.cuda().bfloat16())
    full = [
        unshard([t.detach().double().cpu().transpose(1, 2)], cu_seqlens=cu).transpose(1, 2)
        for t in (out, *(t.grad for t in leaves))
    ]
    flash = _varlen.use_flash(*leaves, variant.softcap)
    return flash, (q, k, v, sinks, dout), (*full, None if ls is None else ls.grad.double().cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.softcap is None], ids=str)
def test_flash_path_on_cuda_matches_the_float64_reference(variant):
    """bf16 on CUDA through FlashAttention-2 (window arguments, a zero-padded value head dim, sinks through
    the log-sum-exp), packed documents of 40 to 1640 tokens, windows scaled alike."""
    variant = Variant(**{**vars(variant), "window": variant.window and 40 * variant.window})
    lengths = [40 * n for n in PACKED_LENGTHS]
    flash, inputs, got = _cuda_bf16_run(variant, lengths)
    assert flash
    expected = _reference(*inputs, lengths, variant)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        if b is not None:
            assert ((a - b).norm() / b.norm()).item() < 2e-2, name


@pytest.mark.gpu
def test_softcap_on_cuda_runs_the_exact_kernel_for_bf16_inputs():
    variant = Variant(softcap=1.0, logit_gain=20.0, window=7, sinks=True, value_dim=5)
    flash, inputs, got = _cuda_bf16_run(variant, list(PACKED_LENGTHS))
    assert not flash
    expected = _reference(*inputs, list(PACKED_LENGTHS), variant)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 2e-2, name


@pytest.mark.gpu
def test_flash_and_torch_kernels_agree_on_cuda_with_a_window_and_a_value_head_dim_of_its_own():
    """Kernel level: pieces with fewer queries than keys (bottom-right), GQA, windows shorter and longer
    than a piece, Dv = 96 < D = 128 (padded for FlashAttention): flash (bf16) vs the torch kernel (fp32)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    pieces = [(0, 64, 0, 64), (64, 192, 64, 448), (192, 193, 448, 1000)]
    cu_q = torch.tensor([0, 64, 192, 193], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 64, 448, 1000], dtype=torch.int32, device="cuda")
    q = torch.randn(193, 8, 128, device="cuda", generator=g)
    k = torch.randn(1000, 2, 128, device="cuda", generator=g)
    v = torch.randn(1000, 2, 96, device="cuda", generator=g)
    dout = torch.randn(193, 8, 96, device="cuda", generator=g)
    for window in (1, 50, 300):
        out, lse = _varlen.torch_forward(q, k, v, pieces, 0.1, window=window)
        grads = _varlen.torch_backward(dout, q, k, v, out, lse, pieces, 0.1, window=window)
        qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
        flash_out, flash_lse, rng = _varlen.flash_forward(
            qb, kb, vb, cu_q, cu_k, 128, 552, 0.1, window=window
        )
        flash_grads = _varlen.flash_backward(
            dout.bfloat16(), qb, kb, vb, flash_out, flash_lse, cu_q, cu_k, 128, 552, 0.1, rng, window=window
        )
        torch.testing.assert_close(flash_lse, lse, rtol=0, atol=2e-2)
        for got, want in zip((flash_out, *flash_grads), (out, *grads), strict=True):
            assert got.shape == want.shape
            assert ((got.float() - want).norm() / want.norm()).item() < 2e-2, window
