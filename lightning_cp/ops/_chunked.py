"""The chunked loss engine: walks the tokens chunk by chunk, never holding ``[tokens, vocab]``.

Per chunk of ``n`` tokens the logits ``z = hidden[chunk] @ weight.T`` (``[n, V_local]``, input dtype)
are handed to a backend (:class:`~lightning_cp.ops._torch_kernels.TorchChunk` or
:class:`~lightning_cp.ops._triton_kernels.TritonChunk`) which reduces every row to softmax partials;
:func:`~lightning_cp.ops._stats.merge` combines them over the tensor-parallel group (one all-gather of
``[6, n]`` floats); the per-token results land in preallocated ``[N]`` buffers (:class:`TokenRows`).

Gradients. Every loss here has a logits gradient of the form
``dL/ds_j = p_j * (alpha + beta * s_j) - gamma * [j == label] - eta`` with per-token coefficients
(:class:`GradCoefs`), times the softcap slope. The backend writes it over the chunk, and a sink streams
it into preallocated gradients:

* linear path: ``grad_hidden[chunk] = d @ weight`` (written once per row) and
  ``grad_weight += d.T @ hidden[chunk]``, accumulated in fp32 for low-precision weights, with the
  product taken in vocabulary blocks so that its temporary stays within the chunk budget;
* logits path: ``grad_logits[chunk] = d``, one buffer in the logits' dtype.

For a scalar loss (``mean`` / ``sum``) with gradients needed, the linear path computes the gradient
of the *summed* loss during the forward (3 matmuls per chunk, like a plain forward + backward) and the
backward only multiplies by ``grad_output`` (and ``1 / count``). Per-token upstream gradients
(``reduction="none"``, :func:`token_logprobs`) recompute the chunk logits in the backward instead
(1 matmul per chunk forward, 3 backward), reusing the saved per-token ``lse``, so no statistics
collective runs in the backward. The logits path always takes the backward route: there it only costs
an elementwise pass. Under tensor parallelism each rank's ``grad_hidden`` is a partial sum over its
vocabulary shard and is all-reduced over the group in the backward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from lightning_cp.ops import _stats
from lightning_cp.ops._torch_kernels import TorchChunk

# One chunk of fp32 logits is about this big; the fp32 weight-gradient product temporary too.
_CHUNK_BUDGET_BYTES = 512 * 2**20
# Fewer tokens per chunk would starve the matmuls for very large vocabularies.
_MIN_CHUNK = 128


def auto_chunk_size(n_tokens: int, local_vocab: int) -> int:
    """Tokens per chunk so that one ``[chunk, local_vocab]`` fp32 block is about 512 MiB, in ``[128, N]``."""
    return max(1, min(n_tokens, max(_MIN_CHUNK, _CHUNK_BUDGET_BYTES // (4 * local_vocab))))


@dataclass(frozen=True)
class Plan:
    """How to walk the logits: backend, chunking, logits transform and vocabulary sharding."""

    impl: str
    """``"torch"`` or ``"triton"``."""
    chunk_size: int
    """Tokens per chunk."""
    softcap: float | None
    """``s = softcap * tanh(z / softcap)`` before the softmax, or no cap."""
    inv_temp: float
    """``s`` is multiplied by this (``1 / temperature``) after the cap."""
    group: dist.ProcessGroup | None
    """Tensor-parallel group over which the vocabulary is sharded, ``None`` when not sharded."""
    local_vocab: int
    """Vocabulary entries on this rank."""
    vocab: int
    """Global vocabulary size."""


@dataclass(frozen=True)
class CEOptions:
    """The cross-entropy options of the public functions (validated there)."""

    reduction: str
    label_smoothing: float
    z_loss: float


@dataclass
class TokenRows:
    """Per-token statistics of the whole input, filled chunk by chunk; all ``[N]``, fp32 unless noted."""

    lse: torch.Tensor
    target: torch.Tensor
    argmax: torch.Tensor
    """int64 global vocabulary id of the first maximal logit."""
    entropy: torch.Tensor | None
    total: torch.Tensor | None
    """``sum_j s_j``; only kept for label smoothing."""

    @classmethod
    def empty(cls, n: int, device: torch.device, *, entropy: bool, smoothing: bool) -> TokenRows:
        def vec() -> torch.Tensor:
            return torch.empty(n, dtype=torch.float32, device=device)

        return cls(
            lse=vec(),
            target=vec(),
            argmax=torch.empty(n, dtype=torch.int64, device=device),
            entropy=vec() if entropy else None,
            total=vec() if smoothing else None,
        )

    def write(self, start: int, stop: int, stats: _stats.ChunkStats) -> None:
        self.lse[start:stop] = stats.lse
        self.target[start:stop] = stats.target
        self.argmax[start:stop] = stats.argmax
        if self.entropy is not None:
            self.entropy[start:stop] = stats.entropy
        if self.total is not None:
            self.total[start:stop] = stats.total


@dataclass
class GradCoefs:
    """Per-token coefficients ``[n]`` (fp32) of ``dL/ds_j = p_j (alpha + beta s_j) - gamma [j = y] - eta``."""

    lse: torch.Tensor
    alpha: torch.Tensor
    gamma: torch.Tensor
    beta: torch.Tensor | None = None
    eta: torch.Tensor | None = None


def _ce_coefs(lse: torch.Tensor, weight: torch.Tensor, opts: CEOptions, vocab: int) -> GradCoefs:
    # d/ds_j of weight * [(1 - eps)(lse - s_y) + eps (lse - sum(s) / V) + z_loss * lse^2]
    #   = weight * [p_j (1 + 2 z_loss lse) - (1 - eps) [j = y] - eps / V]
    eps = opts.label_smoothing
    alpha = weight * (1.0 + 2.0 * opts.z_loss * lse) if opts.z_loss else weight
    return GradCoefs(
        lse=lse,
        alpha=alpha,
        gamma=weight * (1.0 - eps),
        eta=weight * (eps / vocab) if eps else None,
    )


def _logprob_coefs(
    lse: torch.Tensor,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    mean_s: torch.Tensor | None,
    inv_temp: float,
) -> GradCoefs:
    # logprob = s_y - lse:            d/ds_j = [j = y] - p_j
    # entropy = lse - sum_k p_k s_k:  d/ds_j = p_j (E[s] - s_j)
    # and ds/dz carries the 1 / temperature, folded in here.
    if grad_entropy is None:
        return GradCoefs(lse=lse, alpha=-inv_temp * grad_logprob, gamma=-inv_temp * grad_logprob)
    return GradCoefs(
        lse=lse,
        alpha=inv_temp * (grad_entropy * mean_s - grad_logprob),
        gamma=-inv_temp * grad_logprob,
        beta=-inv_temp * grad_entropy,
    )


def _chunk_bounds(n: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, chunk_size):
        yield start, min(start + chunk_size, n)


def _chunk_class(impl: str) -> type:
    if impl == "triton":
        # Imported here, not at module import: TRITON_INTERPRET must be settable until the first Triton use.
        from lightning_cp.ops._triton_kernels import TritonChunk

        return TritonChunk
    return TorchChunk


LogitsOf = Callable[[int, int], tuple[torch.Tensor, bool]]


def _linear_logits(hidden: torch.Tensor, weight: torch.Tensor) -> LogitsOf:
    # A fresh buffer per chunk, owned by the sweep: the backend may overwrite it with the gradient.
    return lambda start, stop: (torch.mm(hidden[start:stop], weight.t()), True)


def _logits_slices(logits: torch.Tensor) -> LogitsOf:
    return lambda start, stop: (logits[start:stop], False)


class _LinearGrads:
    """Streams each chunk's ``dL/dz`` into preallocated ``grad_hidden [N, H]`` and ``grad_weight [V, H]``."""

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, need_hidden: bool, need_weight: bool
    ) -> None:
        self._hidden, self._weight = hidden, weight
        self.hidden = (
            torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        )
        # Summing many chunk products in bf16 would round at every chunk: accumulate in fp32 instead.
        acc_dtype = weight.dtype if weight.dtype.itemsize >= 4 else torch.float32
        self._acc = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
        self._vocab_block = max(1, _CHUNK_BUDGET_BYTES // (weight.shape[1] * weight.dtype.itemsize))

    def out(self, start: int, stop: int) -> None:
        return None

    def add(self, start: int, stop: int, d: torch.Tensor) -> None:
        d = d.to(self._weight.dtype)
        if self.hidden is not None:
            torch.mm(d, self._weight, out=self.hidden[start:stop])
        if self._acc is not None:
            h = self._hidden[start:stop]
            if self._acc.dtype == d.dtype:
                self._acc.addmm_(d.t(), h)
            else:
                for v0, v1 in _chunk_bounds(d.shape[1], self._vocab_block):
                    self._acc[v0:v1].add_(torch.mm(d[:, v0:v1].t(), h))

    def weight_grad(self) -> torch.Tensor | None:
        return None if self._acc is None else self._acc.to(self._weight.dtype)


class _LogitsGrads:
    """One preallocated ``grad_logits [N, V_local]`` in the logits' dtype; backends write into its rows."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)

    def out(self, start: int, stop: int) -> torch.Tensor:
        return self.logits[start:stop]

    def add(self, start: int, stop: int, d: torch.Tensor) -> None:
        """Nothing to do: the backend wrote ``d`` into :meth:`out`."""


def _sweep(
    plan: Plan,
    labels: torch.Tensor,
    logits_of: LogitsOf,
    *,
    rows: TokenRows | None = None,
    coefs: Callable[[int, int, _stats.ChunkStats | None], GradCoefs] | None = None,
    sink: _LinearGrads | _LogitsGrads | None = None,
) -> None:
    """One pass over the chunks: fill ``rows`` with statistics and/or stream gradients into ``sink``."""
    chunk_cls = _chunk_class(plan.impl)
    for start, stop in _chunk_bounds(labels.shape[0], plan.chunk_size):
        z, writable = logits_of(start, stop)
        chunk = chunk_cls(
            z, labels[start:stop], softcap=plan.softcap, inv_temp=plan.inv_temp, writable=writable
        )
        del z  # the chunk owns it now (the torch backend keeps only its fp32 copy)
        stats = None
        if rows is not None:
            partial = chunk.partial_stats(entropy=rows.entropy is not None, smoothing=rows.total is not None)
            stats = _stats.merge(partial, plan.group, plan.local_vocab)
            rows.write(start, stop, stats)
        if coefs is not None:
            c = coefs(start, stop, stats)
            sink.add(
                start, stop, chunk.grad(c.lse, c.alpha, c.gamma, c.beta, c.eta, out=sink.out(start, stop))
            )
        # Free this chunk's buffers before the next chunk's logits are allocated: the peak holds one chunk.
        del chunk


def _ce_token_loss(rows: TokenRows, valid: torch.Tensor, opts: CEOptions, vocab: int) -> torch.Tensor:
    loss = rows.lse - rows.target
    if opts.label_smoothing:
        loss = (1.0 - opts.label_smoothing) * loss + opts.label_smoothing * (rows.lse - rows.total / vocab)
    if opts.z_loss:
        loss = loss + opts.z_loss * rows.lse.square()
    return torch.where(valid, loss, 0.0)


def _reduce(token_loss: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return token_loss
    total = token_loss.sum()
    return total / count.clamp(min=1) if reduction == "mean" else total


def _output_scale(grad_loss: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    """d(loss)/d(token loss) of a valid token: per token for ``none``, a 0-d tensor otherwise."""
    return grad_loss / count.clamp(min=1) if reduction == "mean" else grad_loss


def _sum_over_shards(grad_hidden: torch.Tensor | None, group: dist.ProcessGroup | None) -> None:
    # hidden is replicated over the TP group, each rank saw only its vocabulary shard: sum the partials.
    if grad_hidden is not None and group is not None:
        dist.all_reduce(grad_hidden, group=group)


class LinearCrossEntropy(torch.autograd.Function):
    """``(loss, TokenRows)`` of the cross-entropy of ``hidden @ weight.T`` (see module docstring)."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        plan: Plan,
        opts: CEOptions,
        need_hidden: bool,
        need_weight: bool,
        entropy: bool,
    ) -> tuple[torch.Tensor, TokenRows]:
        rows = TokenRows.empty(
            hidden.shape[0], hidden.device, entropy=entropy, smoothing=opts.label_smoothing > 0
        )
        fused = (need_hidden or need_weight) and opts.reduction != "none"
        grads = _LinearGrads(hidden, weight, need_hidden, need_weight) if fused else None
        row_weight = valid.float()
        _sweep(
            plan,
            labels,
            _linear_logits(hidden, weight),
            rows=rows,
            coefs=(lambda a, b, st: _ce_coefs(st.lse, row_weight[a:b], opts, plan.vocab)) if fused else None,
            sink=grads,
        )
        count = valid.sum()
        loss = _reduce(_ce_token_loss(rows, valid, opts, plan.vocab), count, opts.reduction)
        ctx.plan, ctx.opts, ctx.need = plan, opts, (need_hidden, need_weight)
        ctx.fused = (grads.hidden, grads.weight_grad(), count) if fused else None
        if not fused and (need_hidden or need_weight):
            ctx.save_for_backward(hidden, weight, labels, valid, rows.lse)
        return loss, rows

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _grad_rows: None) -> tuple[torch.Tensor | None, ...]:
        plan, opts = ctx.plan, ctx.opts
        if opts.reduction != "none":
            if ctx.fused is None:
                raise RuntimeError(
                    "linear_cross_entropy computed its gradients during the forward and scaled them in "
                    "place in the first backward; a second backward through the same loss is not "
                    "supported. Recompute the loss instead of using retain_graph=True."
                )
            grad_hidden, grad_weight, count = ctx.fused
            ctx.fused = None
            scale = _output_scale(grad_loss, count, opts.reduction)
            for g in (grad_hidden, grad_weight):
                if g is not None:
                    g.mul_(scale)
        else:
            hidden, weight, labels, valid, lse = ctx.saved_tensors
            row_weight = grad_loss.float() * valid
            grads = _LinearGrads(hidden, weight, *ctx.need)
            _sweep(
                plan,
                labels,
                _linear_logits(hidden, weight),
                coefs=lambda a, b, _: _ce_coefs(lse[a:b], row_weight[a:b], opts, plan.vocab),
                sink=grads,
            )
            grad_hidden, grad_weight = grads.hidden, grads.weight_grad()
        _sum_over_shards(grad_hidden, plan.group)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


class LogitsCrossEntropy(torch.autograd.Function):
    """``(loss, TokenRows)`` of the cross-entropy of given logits ``[N, V_local]``; backward recomputes."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        plan: Plan,
        opts: CEOptions,
        entropy: bool,
    ) -> tuple[torch.Tensor, TokenRows]:
        rows = TokenRows.empty(
            logits.shape[0], logits.device, entropy=entropy, smoothing=opts.label_smoothing > 0
        )
        _sweep(plan, labels, _logits_slices(logits), rows=rows)
        count = valid.sum()
        loss = _reduce(_ce_token_loss(rows, valid, opts, plan.vocab), count, opts.reduction)
        ctx.plan, ctx.opts = plan, opts
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logits, labels, valid, rows.lse, count)
        return loss, rows

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _grad_rows: None) -> tuple[torch.Tensor | None, ...]:
        plan, opts = ctx.plan, ctx.opts
        logits, labels, valid, lse, count = ctx.saved_tensors
        row_weight = _output_scale(grad_loss.float(), count, opts.reduction) * valid
        grads = _LogitsGrads(logits)
        _sweep(
            plan,
            labels,
            _logits_slices(logits),
            coefs=lambda a, b, _: _ce_coefs(lse[a:b], row_weight[a:b], opts, plan.vocab),
            sink=grads,
        )
        return grads.logits, None, None, None, None, None


class LinearLogprobs(torch.autograd.Function):
    """``(logprobs [N], entropy [N] | None)`` under ``softmax(transform(hidden @ weight.T))``.

    The backward takes per-token upstream gradients and recomputes the chunk logits.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        valid: torch.Tensor,
        plan: Plan,
        need_hidden: bool,
        need_weight: bool,
        entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = TokenRows.empty(hidden.shape[0], hidden.device, entropy=entropy, smoothing=False)
        _sweep(plan, labels, _linear_logits(hidden, weight), rows=rows)
        logprobs = torch.where(valid, rows.target - rows.lse, 0.0)
        token_entropy = torch.where(valid, rows.entropy, 0.0) if entropy else None
        ctx.plan, ctx.need = plan, (need_hidden, need_weight)
        if need_hidden or need_weight:
            mean_s = rows.lse - rows.entropy if entropy else None
            ctx.save_for_backward(hidden, weight, labels, valid, rows.lse, mean_s)
        return logprobs, token_entropy

    @staticmethod
    @once_differentiable
    def backward(
        ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.plan
        hidden, weight, labels, valid, lse, mean_s = ctx.saved_tensors
        g_lp = grad_logprobs.float() * valid
        g_ent = None if grad_entropy is None else grad_entropy.float() * valid
        grads = _LinearGrads(hidden, weight, *ctx.need)
        _sweep(
            plan,
            labels,
            _linear_logits(hidden, weight),
            coefs=lambda a, b, _: _logprob_coefs(
                lse[a:b],
                g_lp[a:b],
                None if g_ent is None else g_ent[a:b],
                None if mean_s is None else mean_s[a:b],
                plan.inv_temp,
            ),
            sink=grads,
        )
        grad_hidden, grad_weight = grads.hidden, grads.weight_grad()
        _sum_over_shards(grad_hidden, plan.group)
        return grad_hidden, grad_weight, None, None, None, None, None, None
