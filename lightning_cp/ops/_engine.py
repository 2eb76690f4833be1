"""The chunked loss engine: walks the tokens chunk by chunk, never holding ``[tokens, vocab]``.

Per chunk of ``n`` tokens the logits ``z = hidden[chunk] @ weight.T + bias`` (``[n, V_local]``, input
dtype) are handed to a backend (:class:`~lightning_cp.ops._torch_kernels.TorchChunk` or
:class:`~lightning_cp.ops._triton_kernels.TritonChunk`) which reduces every row to softmax partials;
:func:`~lightning_cp.ops._partials.merge` combines them over the tensor-parallel group (one all-gather of
``[6, n]`` floats) and the per-token results land in the input's :class:`~lightning_cp.ops.TokenStats`.

Gradients. Every loss here has a logits gradient of the form
``dL/ds_j = p_j * (alpha + beta * s_j) - gamma * [j == label] - eta`` with per-token coefficients
(:class:`~lightning_cp.ops._formulas.GradCoefs`, scaled by the plan's ``logit_scale``), times the
softcap slope. The backend writes it over the chunk, and a sink streams it into preallocated gradients:

* ``grad_hidden[chunk] = d @ weight``: each row written once, by one matmul over the local vocabulary;
* ``grad_weight``: for fp32 weights, ``grad_weight += d.T @ hidden[chunk]`` in the same sweep (3 matmuls
  per chunk in all). A low-precision weight's gradient would round at every chunk if summed in its own
  dtype, and an fp32 ``[V, H]`` accumulator costs 2.4 GiB at 151936 x 4096; so it comes from a second,
  vocabulary-outer pass (:func:`_weight_grad_by_vocab_blocks`): per block of ``V_block`` vocabulary
  rows, an fp32 ``[V_block, H]`` accumulator sums ``d_block.T @ hidden[chunk]`` over all token chunks
  (the block's logits recomputed, ``d`` from the saved per-token ``lse``) and is rounded once. That
  pass costs 2 more matmuls per chunk; its accumulator and one chunk's ``[chunk, V_block]`` logits take no
  more than the sweep's ``[chunk, V]`` logits (:func:`_vocab_block_rows`), since on CUDA the products are
  summed into the accumulator in place (:func:`lightning_cp.products.add_product`);
* ``grad_bias`` (an LM-head bias, ``[V_local]``): ``grad_bias += d.sum(0)`` in the same sweep, into an fp32
  accumulator rounded to the bias's dtype once (``V_local`` floats, whatever the weight's dtype);
* logits path: ``grad_logits[chunk] = d``, one buffer in the logits' dtype.

For a scalar loss (``mean`` / ``sum``) with gradients needed, the linear path computes the gradient
of the *summed* loss during the forward and the backward only multiplies by ``grad_output`` (and
``1 / count``). Per-token upstream gradients (``reduction="none"``, ``token_logprobs``) recompute the
chunk logits in the backward instead, reusing the saved per-token ``lse``, so no statistics collective
runs in the backward. The logits path always takes the backward route: there it only costs an
elementwise pass. Under tensor parallelism each rank's ``grad_hidden`` is a partial sum over its
vocabulary shard, all-reduced over the group in the backward (:func:`sum_over_shards`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from lightning_cp import products
from lightning_cp.ops._formulas import CoefsOf, GradCoefs
from lightning_cp.ops._partials import merge
from lightning_cp.ops._plan import Plan
from lightning_cp.ops.token_stats import TokenStats

# At most these bytes of the fp32 [V_block, H] weight-gradient accumulator of a low-precision weight.
_WEIGHT_BLOCK_BYTES = 256 * 2**20


LogitsOf = Callable[[int, int], tuple[torch.Tensor, bool]]
"""The logits of the tokens ``[start, stop)``, and whether the backend may overwrite them."""


def chunk_bounds(n: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, chunk_size):
        yield start, min(start + chunk_size, n)


class Head:
    """The LM head's operands as its matmuls take them, in the plan's :attr:`~lightning_cp.ops._plan.Plan.
    matmul_dtype`: the weight and bias cast once per pass (not at every chunk, as autocast casts an operand that
    is not a leaf), the hidden states chunk by chunk. Without a narrower dtype, the tensors themselves."""

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: Plan
    ) -> None:
        self.dtype = plan.matmul_dtype or hidden.dtype
        self.hidden = hidden
        self.weight = weight.to(self.dtype)
        self.bias = None if bias is None else bias.to(self.dtype)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """The hidden states of tokens ``[start, stop)`` in the matmul dtype."""
        return self.hidden[start:stop].to(self.dtype)

    def logits(self, start: int, stop: int, vocab: slice = slice(None)) -> torch.Tensor:
        """``hidden[start:stop] @ weight[vocab].T (+ bias[vocab])``: one (add)mm in the matmul dtype."""
        weight, h = self.weight[vocab], self.rows(start, stop)
        if self.bias is None:
            return torch.mm(h, weight.t())
        return torch.addmm(self.bias[vocab], h, weight.t())


def linear_logits(head: Head) -> LogitsOf:
    # A fresh buffer per chunk, owned by the sweep: the backend may overwrite it with the gradient.
    return lambda start, stop: (head.logits(start, stop), True)


def logits_slices(logits: torch.Tensor) -> LogitsOf:
    return lambda start, stop: (logits[start:stop], False)


class LogitsGrads:
    """One preallocated ``grad_logits [N, V_local]`` in the logits' dtype; backends write into its rows."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)

    def out(self, start: int, stop: int) -> torch.Tensor:
        return self.logits[start:stop]

    def add(self, start: int, stop: int, d: torch.Tensor) -> None:
        """Nothing to do: the backend wrote ``d`` into :meth:`out`."""


class _TokenChunkGrads:
    """Streams each chunk's ``dL/dz`` into ``grad_hidden [N, H]``, and if asked ``grad_weight [V, H]`` (same
    dtypes as the inputs; only for fp32 weights, see the module docstring) and ``grad_bias [V]`` (fp32). The
    matmuls run in the head's matmul dtype; a narrower one's products are summed into the fp32 weight gradient
    in fp32 (:func:`lightning_cp.products.add_product`) and the hidden gradient's rows cast to its dtype."""

    def __init__(
        self, head: Head, weight: torch.Tensor, *, need_hidden: bool, need_weight: bool, need_bias: bool
    ):
        hidden = head.hidden
        self._head = head
        self.hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else None
        self.weight = torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_weight else None
        self.bias = weight.new_zeros(weight.shape[0], dtype=torch.float32) if need_bias else None

    def out(self, start: int, stop: int) -> None:
        return None

    def add(self, start: int, stop: int, d: torch.Tensor) -> None:
        head = self._head
        if self.bias is not None:
            self.bias.add_(d.sum(0, dtype=torch.float32))
        d = d.to(head.dtype)
        if self.hidden is not None:
            rows = self.hidden[start:stop]
            if rows.dtype == head.dtype:
                torch.mm(d, head.weight, out=rows)
            else:
                rows.copy_(torch.mm(d, head.weight))
        if self.weight is not None:
            if self.weight.dtype == head.dtype:
                self.weight.addmm_(d.t(), head.hidden[start:stop])
            else:
                products.add_product(self.weight, d.t(), head.rows(start, stop))


def sweep(
    plan: Plan,
    labels: torch.Tensor,
    logits_of: LogitsOf,
    *,
    stats: TokenStats | None = None,
    coefs: CoefsOf | None = None,
    sink: _TokenChunkGrads | LogitsGrads | None = None,
) -> None:
    """One pass over the token chunks: fill ``stats`` and/or stream gradients into ``sink``.

    ``labels`` ``[N]`` are local to this vocabulary shard (-1 where ignored or on another shard). A
    chunk's statistics are written before its coefficients are asked for, so ``coefs`` may read them.
    """
    entropy = stats is not None and stats.entropy is not None
    smoothing = stats is not None and stats.total is not None
    for start, stop in chunk_bounds(labels.shape[0], plan.chunk_size):
        z, writable = logits_of(start, stop)
        chunk = plan.chunk(z, labels[start:stop], writable=writable)
        del z  # the chunk owns it now (the torch backend keeps only its fp32 copy)
        if stats is not None:
            partial = chunk.partial_stats(entropy=entropy, smoothing=smoothing)
            merged = merge(
                partial,
                stats.labels[start:stop],
                stats.valid[start:stop],
                group=plan.group,
                local_vocab=plan.local_vocab,
                entropy=entropy,
                smoothing=smoothing,
            )
            stats.write(start, stop, merged)
        if coefs is not None:
            sink.add(
                start, stop, _coefs_at(plan, coefs, start, stop).logits_grad(chunk, out=sink.out(start, stop))
            )
        # Free this chunk's buffers before the next chunk's logits are allocated: the peak holds one chunk.
        del chunk


def _coefs_at(plan: Plan, coefs: CoefsOf, start: int, stop: int) -> GradCoefs:
    """The coefficients of the tokens ``[start, stop)`` for ``dL/dz``: ``ds/dz`` carries ``logit_scale``."""
    return coefs(start, stop).scaled(plan.logit_scale)


def linear_grads(
    plan: Plan,
    hidden: torch.Tensor,
    head: tuple[torch.Tensor, torch.Tensor | None],
    labels: torch.Tensor,
    coefs: CoefsOf,
    *,
    need: tuple[bool, bool, bool],
    stats: TokenStats | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(grad_hidden, grad_weight, grad_bias)`` of the loss whose logits gradient ``coefs`` gives, for the
    head ``(weight, bias)``; ``need`` says which of the three are wanted (the others are ``None``). In the
    inputs' dtypes; also fills ``stats`` when given (the fused forward).

    ``grad_hidden`` is this vocabulary shard's partial sum (see :func:`sum_over_shards`).
    """
    weight, bias = head
    operands = Head(hidden, weight, bias, plan)
    need_hidden, need_weight, need_bias = need
    in_sweep_weight = need_weight and weight.dtype.itemsize >= 4
    sink = _TokenChunkGrads(
        operands, weight, need_hidden=need_hidden, need_weight=in_sweep_weight, need_bias=need_bias
    )
    if stats is not None or need_hidden or in_sweep_weight or need_bias:
        sweep_coefs = coefs if need_hidden or in_sweep_weight or need_bias else None
        sweep(plan, labels, linear_logits(operands), stats=stats, coefs=sweep_coefs, sink=sink)
    grad_bias = None if sink.bias is None else sink.bias.to(bias.dtype)
    grad_weight = sink.weight
    if need_weight and not in_sweep_weight:
        grad_weight = _weight_grad_by_vocab_blocks(plan, operands, weight, labels, coefs)
    return sink.hidden, grad_weight, grad_bias


def _weight_grad_by_vocab_blocks(
    plan: Plan, head: Head, weight: torch.Tensor, labels: torch.Tensor, coefs: CoefsOf
) -> torch.Tensor:
    """``grad_weight`` ``[V_local, H]`` of a low-precision weight, summed in fp32 per vocabulary block over
    all token chunks and rounded to the weight's dtype once.

    The block's logits are recomputed with the input dtype's matmul, as in the statistics pass, so that
    they agree with the saved ``lse``; labels are made relative to the block (-1 outside it: no
    ``-gamma`` term there).
    """
    grad = torch.empty_like(weight, memory_format=torch.contiguous_format)
    n_tokens, hidden_size = head.hidden.shape
    rows = min(plan.chunk_size, n_tokens)  # the tokens of the sweep's largest chunk
    vocab_block = _vocab_block_rows(weight.shape[0], hidden_size, rows, head.dtype.itemsize)
    for v0, v1 in chunk_bounds(weight.shape[0], vocab_block):
        block_labels = torch.where((labels >= v0) & (labels < v1), labels - v0, -1)
        acc = torch.zeros((v1 - v0, hidden_size), dtype=torch.float32, device=weight.device)
        for start, stop in chunk_bounds(n_tokens, plan.chunk_size):
            chunk = plan.chunk(
                head.logits(start, stop, slice(v0, v1)), block_labels[start:stop], writable=True
            )
            d = _coefs_at(plan, coefs, start, stop).logits_grad(chunk)
            del chunk
            products.add_product(acc, d.t().to(head.dtype), head.rows(start, stop))
            del d  # before the next chunk's logits: one chunk's block at a time
        grad[v0:v1] = acc
        del acc  # before the next block's: one accumulator at a time
    return grad


def _vocab_block_rows(vocab: int, hidden: int, chunk: int, itemsize: int) -> int:
    """Vocabulary rows per block of :func:`_weight_grad_by_vocab_blocks`: its fp32 ``[rows, hidden]``
    accumulator and one chunk's ``[chunk, rows]`` logits (``itemsize`` bytes each) take at most the bytes of
    the sweep's ``[chunk, vocab]`` logits, so the weight gradient's pass never raises the loss's peak above
    the sweep's (which is what Liger's fused linear cross-entropy holds at the same chunk); and the
    accumulator at most :data:`_WEIGHT_BLOCK_BYTES`."""
    within_sweep = chunk * vocab * itemsize // (4 * hidden + chunk * itemsize)
    return max(1, min(within_sweep, _WEIGHT_BLOCK_BYTES // (4 * hidden)))


def sum_over_shards(grad_hidden: torch.Tensor | None, group: dist.ProcessGroup | None) -> None:
    """All-reduce ``grad_hidden`` over the tensor-parallel group, in place."""
    # hidden is replicated over the TP group, each rank saw only its vocabulary shard: sum the partials.
    if grad_hidden is not None and group is not None:
        dist.all_reduce(grad_hidden, group=group)
