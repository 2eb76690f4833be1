"""What the fused loss's weight-gradient pass allocates on CUDA, counted on the CPU at Llama-3.1-8B's head.

A bf16 head weight's gradient is summed in fp32 per vocabulary block (``_engine._weight_grad_by_vocab_blocks``).
On CUDA every chunk's product goes into the block's fp32 accumulator in place (``aten::addmm.dtype_out``), and
the block is sized so that the accumulator and one chunk's block logits take no more than the sweep's
``[chunk, V]`` logits, which is what Liger's fused linear cross-entropy holds at the same chunk (its
``logits_chunk``, overwritten by its gradient). The pass runs here on ``meta`` tensors, which take the CUDA
branch (their kernels allocate as CUDA's do, without data); the backend is a stand-in for the Triton chunk,
which writes the gradient over the logits it is given. A dispatch mode counts the bytes of every storage the
pass creates while it lives. The same in-place sum serves an fp32 weight's gradient under DDP's autocast (bf16
matmuls), which took a ``[V, H]`` fp32 temporary at every chunk.
"""

from __future__ import annotations

import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_cp.cli.plan import read_model
from lightning_cp.ops import _engine
from lightning_cp.ops._formulas import GradCoefs
from lightning_cp.ops._plan import Plan
from lightning_cp.plan import plan

MIB = 2**20
ROOT = Path(__file__).resolve().parents[2]
LLAMA_HEAD = {"vocab": 128256, "hidden": 4096}
"""Llama-3.1-8B's LM head."""
TOKENS = 32768
"""Tokens on the rank (the GPU report's loss shape)."""
CHUNK = 1024
"""The plan's chunk for the loss at 32K tokens on one GPU (its minimum), and Liger's at this shape:
``next_pow2(ceil(32768 / ceil(128256 / 4096)))``."""


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages the dispatched operators create, live and at their peak, and the operators."""

    def __init__(self, *known: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.ops: Counter[torch._ops.OpOverload] = Counter()
        self._storages = {id(t.untyped_storage()) for t in known}  # the inputs: not counted

    def _freed(self, key: int, nbytes: int) -> None:
        self._storages.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if id(storage) not in self._storages:
                self._storages.add(id(storage))
                self.live += storage.nbytes()
                weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


class _InPlaceChunk:
    """The Triton chunk's allocations: the gradient written over the writable logits it was given."""

    def __init__(self, z: torch.Tensor, local_labels: torch.Tensor, **transform: object) -> None:
        self._z = z

    def grad(self, lse, alpha, gamma, beta=None, eta=None, out=None) -> torch.Tensor:
        return self._z if out is None else out


def _weight_pass(monkeypatch, vocab: int, hidden: int) -> tuple[_LiveBytes, torch.Tensor]:
    """The weight-gradient pass of a bf16 ``[vocab, hidden]`` head over :data:`TOKENS` tokens in chunks of
    :data:`CHUNK`, counted: the counter and the gradient."""
    monkeypatch.setattr(Plan, "_backend", lambda self: _InPlaceChunk)
    plan = Plan("triton", CHUNK, 1.0, None, 1.0, None, vocab, vocab)
    hidden_states = torch.empty(TOKENS, hidden, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(vocab, hidden, dtype=torch.bfloat16, device="meta")
    labels = torch.empty(TOKENS, dtype=torch.long, device="meta")
    per_token = torch.empty(TOKENS, dtype=torch.float32, device="meta")

    def coefs(start: int, stop: int) -> GradCoefs:
        return GradCoefs(per_token[start:stop], per_token[start:stop], per_token[start:stop])

    head = _engine.Head(hidden_states, weight, None, plan)
    with _LiveBytes(hidden_states, weight, labels, per_token) as counted:
        grad = _engine._weight_grad_by_vocab_blocks(plan, head, weight, labels, coefs)
    return counted, grad


def test_the_weight_pass_holds_no_more_than_one_chunk_of_logits_at_llama_s_head(monkeypatch):
    """Llama-3.1-8B's head, 32K tokens in chunks of 1,024, bf16: beyond the gradient it returns, the pass holds
    251 MiB, within what Liger holds at that chunk (258.5 MiB: its ``[chunk, V]`` bf16 logits and its
    ``grad_logits_chunk @ weight`` ``[chunk, H]`` before the copy into ``grad_input``, from its source). It held
    1,002 MiB before: two 256 MiB accumulators (the next block's allocated before the last one's was dropped),
    the GEMM's 256 MiB fp32 output beside them and two chunks' block logits. Every product goes into the
    accumulator in place, one GEMM per block and chunk."""
    vocab, hidden = LLAMA_HEAD["vocab"], LLAMA_HEAD["hidden"]
    counted, grad = _weight_pass(monkeypatch, vocab, hidden)

    extra = counted.peak - grad.nbytes
    logits = CHUNK * vocab * 2  # Liger's logits_chunk, in the weight's dtype
    liger = logits + CHUNK * hidden * 2
    assert extra <= liger, (extra / MIB, liger / MIB)
    assert extra >= 0.95 * logits  # the block is as large as that allows: no needless extra passes
    # The plan's loss term at this chunk, besides the input and the gradients, covers it (the GPU report's
    # loss section holds ours to that term).
    shape = read_model(str(ROOT / "examples" / "configs" / "models" / "llama3_8b.json"))
    chosen = next(c for c in plan(shape, TOKENS, 1) if c.fits(80 * 10**9))
    assert chosen.loss_chunk == CHUNK
    outside = (
        2 * TOKENS * hidden * 2 + vocab * hidden * 4
    )  # the input, its gradient (bf16), the head's (fp32)
    assert extra <= chosen.estimate.loss - outside
    rows = _engine._vocab_block_rows(vocab, hidden, CHUNK, 2)
    blocks, chunks = -(-vocab // rows), TOKENS // CHUNK
    in_place = counted.ops[torch.ops.aten.addmm.dtype_out]
    assert (in_place, counted.ops[torch.ops.aten.mm.dtype]) == (blocks * chunks, 0)


def test_under_ddp_s_autocast_the_fp32_weight_gradient_takes_no_vocab_by_hidden_temporary(monkeypatch):
    """``bf16-mixed`` under DDP: fp32 hidden states and head weight, bf16 matmuls. Each chunk's bf16 product
    goes into the fp32 weight gradient in place: beyond the two gradients and the weight's bf16 copy (which
    autocast makes too) the loss holds one chunk's logits and two ``[chunk, H]`` bf16 rows (the hidden
    gradient's product, the hidden rows cast), 258.5 MiB at Llama-3.1-8B's head; it held 2,262.5 MiB, the
    GEMM's ``[V, H]`` fp32 output at every chunk."""
    monkeypatch.setattr(Plan, "_backend", lambda self: _InPlaceChunk)
    vocab, hidden, tokens = LLAMA_HEAD["vocab"], LLAMA_HEAD["hidden"], 8 * CHUNK
    plan = Plan("triton", CHUNK, 1.0, None, 1.0, None, vocab, vocab, matmul_dtype=torch.bfloat16)
    hidden_states = torch.empty(tokens, hidden, device="meta")
    weight = torch.empty(vocab, hidden, device="meta")
    labels = torch.empty(tokens, dtype=torch.long, device="meta")
    per_token = torch.empty(tokens, device="meta")

    def coefs(start: int, stop: int) -> GradCoefs:
        return GradCoefs(per_token[start:stop], per_token[start:stop], per_token[start:stop])

    with _LiveBytes(hidden_states, weight, labels, per_token) as counted:
        grad_hidden, grad_weight, _ = _engine.linear_grads(
            plan, hidden_states, (weight, None), labels, coefs, need=(True, True, False)
        )
    assert grad_weight.dtype == torch.float32
    extra = counted.peak - grad_hidden.nbytes - grad_weight.nbytes - vocab * hidden * 2
    assert extra <= CHUNK * vocab * 2 + 2 * CHUNK * hidden * 2, extra / MIB
    assert counted.ops[torch.ops.aten.addmm.dtype_out] == tokens // CHUNK
