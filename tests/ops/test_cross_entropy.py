"""The torch path of ``lightning_cp.ops`` against plain PyTorch on materialized fp32 logits."""

from __future__ import annotations

import subprocess
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_cp.ops import (
    TokenStats,
    _engine,
    _torch_kernels,
    cross_entropy,
    cross_entropy_with_stats,
    linear_cross_entropy,
    linear_cross_entropy_with_stats,
    token_logprobs,
    token_logprobs_with_entropy,
)
from lightning_cp.ops._plan import auto_chunk_size
from tests.ops import _reference as ref
from tests.ops import _softcap_cases
from tests.ops._reference import IGNORE, assert_close, make_case, upcast_leaves

N, H, V = 37, 16, 50  # a prime token count: chunks of 8 leave a ragged last chunk

OPTIONS = {
    "plain": {},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 3.0},
    "all": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 2.0},
}


def _ce_options(option: str) -> dict:
    return {k: v for k, v in OPTIONS[option].items() if k != "softcap"}


def _upstream(loss: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A non-trivial upstream gradient: random per token for ``none``, 0.7 for a scalar (tests scaling)."""
    if loss.dim() == 0:
        return torch.tensor(0.7)
    return torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_linear_cross_entropy_matches_reference(option, reduction, chunk_size):
    hidden, weight, labels = make_case(N, H, V)
    loss = linear_cross_entropy(
        hidden, weight, labels, reduction=reduction, chunk_size=chunk_size, impl="torch", **OPTIONS[option]
    )
    up = _upstream(loss)
    (loss * up).sum().backward()

    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    z = ref.head_logits(ref_hidden, ref_weight, OPTIONS[option].get("softcap"))
    expected = ref.cross_entropy(z, labels, reduction=reduction, **_ce_options(option))
    (expected * up).sum().backward()

    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    assert_close(loss, expected)
    assert_close(hidden.grad, ref_hidden.grad)
    assert_close(weight.grad, ref_weight.grad)


@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option", ["plain", "smoothing", "z_loss", "all"])
def test_cross_entropy_from_logits_matches_reference(option, reduction, chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(N, V, generator=g)).requires_grad_()
    before = logits.detach().clone()
    _, _, labels = make_case(N, H, V)
    loss = cross_entropy(
        logits, labels, reduction=reduction, chunk_size=chunk_size, impl="torch", **OPTIONS[option]
    )
    up = _upstream(loss)
    (loss * up).sum().backward()

    ref_logits = before.clone().requires_grad_()
    z = ref.transform(ref_logits, OPTIONS[option].get("softcap"))
    expected = ref.cross_entropy(z, labels, reduction=reduction, **_ce_options(option))
    (expected * up).sum().backward()

    assert_close(loss, expected)
    assert logits.grad.dtype == logits.dtype
    assert_close(logits.grad, ref_logits.grad)
    assert torch.equal(logits.detach(), before), "the caller's logits were modified"


@pytest.mark.parametrize("chunk_size", [None, 8])
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_reference(temperature, softcap, with_entropy, chunk_size):
    hidden, weight, labels = make_case(N, H, V)
    function = token_logprobs_with_entropy if with_entropy else token_logprobs
    out = function(
        hidden, weight, labels, temperature=temperature, softcap=softcap, chunk_size=chunk_size, impl="torch"
    )
    logprobs, entropy = out if with_entropy else (out, None)
    up_lp, up_ent = _upstream(logprobs, seed=1), _upstream(logprobs, seed=2)
    objective = (logprobs * up_lp).sum() + ((entropy * up_ent).sum() if with_entropy else 0.0)
    objective.backward()

    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    exp_lp, exp_ent = ref.logprobs_and_entropy(
        ref.head_logits(ref_hidden, ref_weight, softcap, temperature), labels
    )
    ((exp_lp * up_lp).sum() + ((exp_ent * up_ent).sum() if with_entropy else 0.0)).backward()

    assert logprobs.dtype == torch.float32
    assert_close(logprobs, exp_lp)
    if with_entropy:
        assert_close(entropy, exp_ent)
    assert_close(hidden.grad, ref_hidden.grad)
    assert_close(weight.grad, ref_weight.grad)


def _labels_half_argmax(z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Random labels are almost never the arg-max; make every other one the arg-max so `correct` is tested.
    labels = labels.clone()
    labels[1::2] = z.argmax(dim=-1)[1::2]
    return labels


@pytest.mark.parametrize("path", ["linear", "logits"])
@pytest.mark.parametrize("option", ["plain", "all"])
def test_token_stats_match_reference(path, option):
    hidden, weight, labels = make_case(N, H, V)
    softcap = OPTIONS[option].get("softcap")
    z = ref.head_logits(hidden.detach(), weight.detach(), softcap)
    labels = _labels_half_argmax(z, labels)
    if path == "linear":
        _, stats = linear_cross_entropy_with_stats(
            hidden, weight, labels, chunk_size=8, impl="torch", **OPTIONS[option]
        )
    else:
        logits = (hidden @ weight.t()).detach()
        _, stats = cross_entropy_with_stats(logits, labels, chunk_size=8, impl="torch", **OPTIONS[option])

    assert isinstance(stats, TokenStats)
    expected = ref.token_stats(z, labels)
    assert stats.correct.any() and stats.correct.dtype == torch.bool
    assert torch.equal(stats.correct, expected["correct"])
    assert torch.equal(stats.valid, expected["valid"])
    for name in ("nll", "entropy"):
        value = getattr(stats, name)
        assert value.dtype == torch.float32 and not value.requires_grad
        assert_close(value, expected[name])


@pytest.mark.parametrize("path", ["linear", "logits"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_several_vocabulary_blocks_per_chunk(monkeypatch, path, option):
    """The torch backend walks each chunk in column blocks; force 8 of them here (V is small)."""
    monkeypatch.setattr(_torch_kernels, "_BLOCK_ELEMENTS", 8 * 7)
    monkeypatch.setattr(_torch_kernels, "_MIN_BLOCK_COLUMNS", 7)
    assert len(_torch_kernels._blocks(8, V)) == 8
    hidden, weight, labels = make_case(N, H, V)
    softcap = OPTIONS[option].get("softcap")
    labels = _labels_half_argmax(ref.head_logits(hidden.detach(), weight.detach(), softcap), labels)
    if path == "linear":
        inputs = (hidden, weight)
        loss, stats = linear_cross_entropy_with_stats(
            hidden, weight, labels, chunk_size=8, impl="torch", **OPTIONS[option]
        )
    else:
        logits = (hidden @ weight.t()).detach().requires_grad_()
        inputs = (logits,)
        loss, stats = cross_entropy_with_stats(logits, labels, chunk_size=8, impl="torch", **OPTIONS[option])
    loss.backward()

    ref_inputs = upcast_leaves(*inputs)
    z = ref.head_logits(*ref_inputs, softcap) if path == "linear" else ref.transform(ref_inputs[0], softcap)
    expected = ref.cross_entropy(z, labels, **_ce_options(option))
    expected.backward()
    assert_close(loss, expected)
    for got, want in zip(inputs, ref_inputs):
        assert_close(got.grad, want.grad)
    reference_stats = ref.token_stats(z.detach(), labels)
    assert torch.equal(stats.correct, reference_stats["correct"])
    assert_close(stats.entropy, reference_stats["entropy"])


@pytest.mark.parametrize("labels, correct", [([5, 30, IGNORE, 7], [True, False, False, False])])
def test_correct_breaks_ties_to_the_first_maximum(labels, correct):
    # torch.argmax returns the first maximal index; the chunked arg-max must agree on exact ties.
    logits = torch.zeros(4, 40)
    logits[:, 5] = logits[:, 30] = 2.0
    labels = torch.tensor(labels)
    _, stats = cross_entropy_with_stats(logits, labels, impl="torch")
    assert stats.correct.tolist() == correct
    assert torch.equal(stats.correct, (logits.argmax(-1) == labels) & (labels != IGNORE))


def test_masked_minus_inf_logits_give_finite_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g)
    logits[:, V - 7 :] = float("-inf")  # e.g. padded vocabulary entries masked out
    _, _, labels = make_case(N, H, V - 7)
    logits.requires_grad_()
    loss, stats = cross_entropy_with_stats(logits, labels, chunk_size=8, impl="torch")
    loss.backward()

    ref_logits = logits.detach().clone().requires_grad_()
    expected = ref.cross_entropy(ref_logits, labels)
    expected.backward()
    assert_close(loss, expected)
    assert_close(logits.grad, ref_logits.grad)
    assert torch.isfinite(stats.entropy).all()
    assert_close(stats.entropy, ref.token_stats(ref_logits, labels)["entropy"])


@pytest.mark.parametrize("softcap", _softcap_cases.SOFTCAPS)
@pytest.mark.parametrize("path", _softcap_cases.PATHS)
def test_saturated_softcap_matches_reference(path, softcap):
    _softcap_cases.check_saturated_softcap(path, softcap, "torch", torch.device("cpu"))


@pytest.mark.parametrize("path", ["linear", "logits", "logprobs"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(path, reduction):
    hidden, weight, _ = make_case(N, H, V)
    labels = torch.full((N,), IGNORE)
    if path == "linear":
        out = linear_cross_entropy(
            hidden, weight, labels, reduction=reduction, chunk_size=8, impl="torch", z_loss=1e-2
        )
        leaves = [hidden, weight]
    elif path == "logits":
        logits = (hidden @ weight.t()).detach().requires_grad_()
        out = cross_entropy(
            logits, labels, reduction=reduction, chunk_size=8, impl="torch", label_smoothing=0.1
        )
        leaves = [logits]
    else:
        lp, ent = token_logprobs_with_entropy(hidden, weight, labels, chunk_size=8, impl="torch")
        out = lp + ent
        leaves = [hidden, weight]
    (out * _upstream(out)).sum().backward()
    assert torch.equal(out, torch.zeros_like(out))
    for leaf in leaves:
        assert torch.equal(leaf.grad, torch.zeros_like(leaf))


@pytest.mark.parametrize("path", ["linear", "logits", "logprobs"])
def test_low_precision_inputs_are_close_to_fp32_reference(path):
    hidden, weight, labels = make_case(N, H, V, torch.bfloat16)
    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    if path == "linear":
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=8, impl="torch", **OPTIONS["all"])
        expected = ref.cross_entropy(
            ref.head_logits(ref_hidden, ref_weight, OPTIONS["all"]["softcap"]), labels, **_ce_options("all")
        )
        leaves, ref_leaves = [hidden, weight], [ref_hidden, ref_weight]
    elif path == "logits":
        logits = (hidden @ weight.t()).detach().requires_grad_()
        ref_logits = logits.detach().float().requires_grad_()
        loss = cross_entropy(logits, labels, chunk_size=8, impl="torch", reduction="sum")
        expected = ref.cross_entropy(ref_logits, labels, reduction="sum")
        leaves, ref_leaves = [logits], [ref_logits]
    else:
        lp, ent = token_logprobs_with_entropy(hidden, weight, labels, chunk_size=8, impl="torch")
        exp_lp, exp_ent = ref.logprobs_and_entropy(ref.head_logits(ref_hidden, ref_weight), labels)
        loss, expected = lp.sum() - 0.1 * ent.sum(), exp_lp.sum() - 0.1 * exp_ent.sum()
        leaves, ref_leaves = [hidden, weight], [ref_hidden, ref_weight]
    loss.backward()
    expected.backward()
    assert loss.dtype == torch.float32
    assert_close(loss, expected, torch.bfloat16)
    for leaf, ref_leaf in zip(leaves, ref_leaves, strict=True):
        assert leaf.grad.dtype == torch.bfloat16
        assert_close(leaf.grad, ref_leaf.grad, torch.bfloat16)


@pytest.mark.parametrize("path", ["linear", "logprobs"])
def test_low_precision_weight_gradient_in_vocabulary_blocks(monkeypatch, path):
    # A tiny budget makes the weight-gradient pass walk 3-row vocabulary blocks (50 = 16 * 3 + 2: the
    # last one ragged), each with its own fp32 accumulator and labels relative to the block.
    monkeypatch.setattr(_engine, "_WEIGHT_BLOCK_BYTES", 3 * H * 4)
    hidden, weight, labels = make_case(N, H, V, torch.bfloat16)
    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    if path == "linear":
        linear_cross_entropy(hidden, weight, labels, chunk_size=8, impl="torch", **OPTIONS["all"]).backward()
        z = ref.head_logits(ref_hidden, ref_weight, OPTIONS["all"]["softcap"])
        ref.cross_entropy(z, labels, **_ce_options("all")).backward()
    else:
        lp, ent = token_logprobs_with_entropy(
            hidden,
            weight,
            labels,
            temperature=0.7,
            softcap=2.0,
            chunk_size=8,
            impl="torch",
        )
        (lp * _upstream(lp)).sum().add(ent.sum()).backward()
        exp_lp, exp_ent = ref.logprobs_and_entropy(ref.head_logits(ref_hidden, ref_weight, 2.0, 0.7), labels)
        (exp_lp * _upstream(exp_lp)).sum().add(exp_ent.sum()).backward()
    assert_close(weight.grad, ref_weight.grad, torch.bfloat16)
    assert_close(hidden.grad, ref_hidden.grad, torch.bfloat16)


@pytest.mark.parametrize("path", ["linear-mean", "logprobs"])
def test_low_precision_weight_gradient_of_many_chunks_is_summed_in_fp32(path):
    # 4096 tokens in 256 chunks: a bf16 running sum of the chunks' weight gradients ends ~2% (in norm)
    # from the fp32 reference, the fp32 sum ~0.3%, and assert_close allows 0.5%.
    n, hidden_size, vocab, chunk = 4096, 64, 256, 16
    hidden, weight, labels = make_case(n, hidden_size, vocab, torch.bfloat16)
    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    if path == "linear-mean":
        linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, impl="torch").backward()
        ref.cross_entropy(ref.head_logits(ref_hidden, ref_weight), labels).backward()
    else:
        up = _upstream(labels.float())
        (token_logprobs(hidden, weight, labels, chunk_size=chunk, impl="torch") * up).sum().backward()
        (ref.logprobs_and_entropy(ref.head_logits(ref_hidden, ref_weight), labels)[0] * up).sum().backward()
    assert weight.grad.dtype == torch.bfloat16
    assert_close(weight.grad, ref_weight.grad, torch.bfloat16)
    assert_close(hidden.grad, ref_hidden.grad, torch.bfloat16)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("trainable", ["hidden", "weight"])
def test_gradient_of_one_input_only(trainable, reduction):
    hidden, weight, labels = make_case(N, H, V)
    frozen = weight if trainable == "hidden" else hidden
    frozen.requires_grad_(False)
    loss = linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=8, impl="torch")
    (loss * _upstream(loss)).sum().backward()

    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    expected = ref.cross_entropy(ref.head_logits(ref_hidden, ref_weight), labels, reduction=reduction)
    (expected * _upstream(expected)).sum().backward()
    assert frozen.grad is None
    if trainable == "hidden":
        assert_close(hidden.grad, ref_hidden.grad)
    else:
        assert_close(weight.grad, ref_weight.grad)


def test_non_contiguous_hidden():
    # Megatron's [S, B, H] activations reach the head as strided views.
    hidden, weight, labels = make_case(N, H, V)
    base = hidden.detach().t().contiguous().requires_grad_()
    loss = linear_cross_entropy(base.t(), weight, labels, chunk_size=8, impl="torch")
    loss.backward()
    ref_hidden, ref_weight = upcast_leaves(hidden, weight)
    ref.cross_entropy(ref.head_logits(ref_hidden, ref_weight), labels).backward()
    assert_close(base.grad.t(), ref_hidden.grad)


def test_second_backward_through_fused_loss_raises():
    hidden, weight, labels = make_case(N, H, V)
    loss = linear_cross_entropy(hidden, weight, labels, impl="torch")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


class _OpRecorder(TorchDispatchMode):
    """Records every aten op, the largest tensor any op produces (elements, per dtype) and the peak of
    live bytes allocated by ops under it (the CPU has no allocator statistics to ask).

    A storage counts as live while any tensor the recorder saw on it is alive; the storages of
    ``existing`` tensors (the inputs) are not counted.
    """

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.ops: list = []
        self.largest: dict[torch.dtype, int] = {}
        self.live = self.peak = 0
        self._known = {t.untyped_storage().data_ptr() for t in existing}
        self._holders: dict[int, int] = {}
        self._nbytes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.overloadpacket)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._known or storage.nbytes() == 0:
            return
        if key not in self._holders:
            self._holders[key], self._nbytes[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._holders[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live -= self._nbytes.pop(key)

    def count(self, *packets) -> int:
        return sum(op in packets for op in self.ops)


_MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.matmul)
_HOST_SYNC = (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.masked_select)


@pytest.mark.parametrize(
    "reduction, grad_enabled, trainable, matmuls_per_chunk",
    [
        ("mean", True, ("hidden", "weight"), 3),  # gradients computed in the forward, scaled in the backward
        ("sum", True, ("weight",), 2),  # no hidden gradient: its matmul is skipped
        ("none", True, ("hidden", "weight"), 4),  # 1 forward + 3 recomputing backward
        ("mean", False, ("hidden", "weight"), 1),  # no grad mode: logits only
    ],
)
def test_chunked_pass_memory_matmuls_and_syncs(reduction, grad_enabled, trainable, matmuls_per_chunk):
    n, hidden_size, vocab, chunk = 64, 4, 32, 8  # [n, vocab] is 8x any [chunk, vocab] or [vocab, H] buffer
    hidden, weight, labels = make_case(n, hidden_size, vocab)
    hidden.requires_grad_("hidden" in trainable)
    weight.requires_grad_("weight" in trainable)
    up = torch.randn(n) if reduction == "none" else torch.tensor(1.3)
    recorder = _OpRecorder()
    with recorder, torch.set_grad_enabled(grad_enabled):
        loss = linear_cross_entropy(
            hidden, weight, labels, reduction=reduction, chunk_size=chunk, impl="torch"
        )
        if grad_enabled:
            (loss * up).sum().backward()
    assert max(recorder.largest.values()) <= chunk * vocab
    assert recorder.count(*_MATMULS) == matmuls_per_chunk * (n // chunk)
    assert recorder.count(torch.ops.aten.cat, torch.ops.aten.stack) == 0
    # One host sync in all: the CPU label range check (a device-side assert on CUDA), not one per chunk.
    assert recorder.count(*_HOST_SYNC) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weight_gradient_needs_no_fp32_vocab_by_hidden_buffer(monkeypatch, dtype):
    # (The block is also held to the sweep's [chunk, V] logits: 204 rows here, so the budget's 128 decide.)
    n, hidden_size, vocab, chunk, block = 256, 64, 1024, 32, 128
    monkeypatch.setattr(_engine, "_WEIGHT_BLOCK_BYTES", block * hidden_size * 4)
    hidden, weight, labels = make_case(n, hidden_size, vocab, dtype)
    recorder = _OpRecorder(hidden, weight, labels)
    with recorder:
        linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, impl="torch").backward()
    # fp32: [chunk, V] logits of the token sweep, [chunk, block] logits and a [block, H] accumulator of
    # the vocabulary-block pass, [chunk, H] upcast hidden rows; never [V, H].
    assert recorder.largest[torch.float32] <= max(chunk * vocab, block * hidden_size) < vocab * hidden_size
    # Token sweep: logits and grad_hidden; then per vocabulary block: logits and grad_weight.
    assert recorder.count(*_MATMULS) == (2 + 2 * vocab // block) * (n // chunk)
    assert weight.grad.dtype == dtype and hidden.grad.dtype == dtype


def test_logits_path_upcasts_one_chunk_at_a_time():
    n, vocab, chunk = 64, 32, 8
    logits = torch.randn(n, vocab, dtype=torch.bfloat16, requires_grad=True)
    _, _, labels = make_case(n, 4, vocab)
    recorder = _OpRecorder()
    with recorder:
        cross_entropy_with_stats(logits, labels, chunk_size=chunk, impl="torch")[0].backward()
    assert recorder.largest[torch.float32] <= chunk * vocab
    assert recorder.largest[torch.bfloat16] == n * vocab  # the one gradient buffer, in the logits' dtype
    assert logits.grad.dtype == torch.bfloat16


def _fwd_bwd(path: str, chunk: int, n: int, vocab: int) -> _OpRecorder:
    hidden, weight, labels = make_case(n, 4, vocab)
    logits = torch.randn(n, vocab, dtype=torch.bfloat16, requires_grad=True)
    recorder = _OpRecorder(hidden, weight, labels, logits)
    with recorder:
        if path == "logprobs":
            lp, ent = token_logprobs_with_entropy(hidden, weight, labels, softcap=3.0, chunk_size=chunk)
            (lp.sum() + ent.sum()).backward()
        elif path == "logits":
            cross_entropy_with_stats(logits, labels, softcap=3.0, chunk_size=chunk)[0].backward()
        else:
            reduction = path.split("-")[1]
            loss, _ = linear_cross_entropy_with_stats(
                hidden, weight, labels, reduction=reduction, chunk_size=chunk, impl="torch"
            )
            loss.sum().backward()
    return recorder


@pytest.mark.parametrize("path", ["linear-mean", "linear-none", "logprobs", "logits"])
def test_extra_peak_memory_grows_with_the_chunk_not_the_tokens(path):
    n, vocab = 256, 64
    fp32_logits = n * vocab * 4
    # The logits path must hold its one gradient buffer (the logits' dtype, bf16 here) and nothing
    # else of size [N, V]: no fp32 upcast, no log-softmax.
    floor = n * vocab * 2 if path == "logits" else 0
    small, large = (_fwd_bwd(path, chunk, n, vocab).peak - floor for chunk in (8, 32))
    assert small < fp32_logits / 2
    # A few fp32 [chunk, V] buffers (logits, exp / gradient, a softcap temporary), one chunk at a time.
    assert large - small <= 4 * (32 - 8) * vocab * 4


def test_auto_chunk_size_fits_the_budget():
    vocab = 152_064
    for device, budget in (("cpu", 256 * 2**20), ("mps", 512 * 2**20)):
        chunk = auto_chunk_size(131_072, vocab, device)
        assert 128 <= chunk < 131_072 and budget / 2 < chunk * vocab * 4 <= budget
    assert auto_chunk_size(37, vocab) == 37
    assert auto_chunk_size(10**6, 10**7) == 128


def _bad_call(kind: str):
    hidden, weight, labels = make_case(N, H, V)
    calls = {
        "label >= V": lambda: linear_cross_entropy(
            hidden, weight, labels.index_fill(0, torch.tensor([1]), V)
        ),
        "negative label": lambda: linear_cross_entropy(
            hidden, weight, labels.index_fill(0, torch.tensor([2]), -1)
        ),
        "logits label >= V": lambda: cross_entropy(
            hidden @ weight.t(), labels.index_fill(0, torch.tensor([1]), V + 3)
        ),
        "hidden size": lambda: linear_cross_entropy(hidden[:, :-1], weight, labels),
        "weight transposed": lambda: linear_cross_entropy(hidden, weight.t(), labels),
        "labels length": lambda: linear_cross_entropy(hidden, weight, labels[:-1]),
        "labels 2-D": lambda: cross_entropy(hidden @ weight.t(), labels[None]),
        "float labels": lambda: linear_cross_entropy(hidden, weight, labels.float()),
        "3-D hidden": lambda: linear_cross_entropy(hidden[None], weight, labels),
        "dtype mismatch": lambda: linear_cross_entropy(hidden, weight.double(), labels),
        "reduction": lambda: linear_cross_entropy(hidden, weight, labels, reduction="avg"),
        "impl": lambda: linear_cross_entropy(hidden, weight, labels, impl="cuda"),
        "chunk_size": lambda: linear_cross_entropy(hidden, weight, labels, chunk_size=0),
        "label_smoothing": lambda: cross_entropy(hidden @ weight.t(), labels, label_smoothing=1.5),
        "softcap": lambda: linear_cross_entropy(hidden, weight, labels, softcap=0.0),
        "temperature": lambda: token_logprobs(hidden, weight, labels, temperature=0.0),
        "another function's option": lambda: linear_cross_entropy_with_stats(
            hidden, weight, labels, temperature=0.7
        ),
        "misspelled option": lambda: token_logprobs_with_entropy(hidden, weight, labels, chunksize=8),
    }
    return calls[kind]


@pytest.mark.parametrize(
    "kind, error, match",
    [
        ("label >= V", ValueError, rf"`labels` must be in \[0, {V}\) or equal ignore_index=-100, got {V}\b"),
        ("negative label", ValueError, rf"`labels` must be in \[0, {V}\) .*got -1\b"),
        ("logits label >= V", ValueError, rf"\[0, {V}\) .*got {V + 3}\b"),
        ("hidden size", ValueError, r"last \(hidden\) dimensions must match"),
        ("weight transposed", ValueError, r"not its transpose"),
        ("labels length", ValueError, rf"`labels` must have shape \({N},\).*got \({N - 1},\)"),
        ("labels 2-D", ValueError, rf"`labels` must have shape \({N},\)"),
        ("float labels", TypeError, r"`labels` must hold integer vocabulary ids, got dtype torch.float32"),
        ("3-D hidden", ValueError, r"`hidden` must be 2-D \[N, H\]"),
        ("dtype mismatch", ValueError, r"`weight` is torch.float64 .* `hidden` is torch.float32"),
        ("reduction", ValueError, r"`reduction` must be one of .*got 'avg'"),
        ("impl", ValueError, r"`impl` must be one of .*got 'cuda'"),
        ("chunk_size", ValueError, r"`chunk_size` must be a positive int .*got 0"),
        ("label_smoothing", ValueError, r"`label_smoothing` must be in \[0, 1\], got 1.5"),
        ("softcap", ValueError, r"`softcap` must be > 0 or None"),
        ("temperature", ValueError, r"`temperature` must be > 0, got 0.0"),
        ("another function's option", TypeError, r"unexpected keyword argument 'temperature'"),
        ("misspelled option", TypeError, r"unexpected keyword argument 'chunksize'"),
    ],
)
def test_bad_input_raises_early_with_a_clear_message(kind, error, match):
    with pytest.raises(error, match=match):
        _bad_call(kind)()


def test_triton_on_cpu_without_the_interpreter_raises(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, labels = make_case(N, H, V)
    with pytest.raises(
        ValueError, match=r"impl='triton' runs on CUDA tensors, got tensors on cpu.*TRITON_INTERPRET=1"
    ):
        linear_cross_entropy(hidden, weight, labels, impl="triton")


@pytest.mark.gpu
def test_out_of_range_label_on_cuda_is_a_device_side_assert():
    # A device-side assert poisons the CUDA context, so it runs in its own process.
    code = (
        "import torch\n"
        "from lightning_cp.ops import linear_cross_entropy\n"
        "h = torch.randn(8, 4, device='cuda'); w = torch.randn(10, 4, device='cuda')\n"
        "y = torch.full((8,), 3, device='cuda'); y[5] = 10\n"
        "linear_cross_entropy(h, w, y)\n"
        "torch.cuda.synchronize()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "assert" in result.stderr.lower()
