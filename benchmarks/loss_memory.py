"""Peak memory and time of LM-head + cross-entropy implementations, side by side in one run.

Every case computes the same thing: ``loss = mean CE(hidden @ weight.T, labels)`` over the tokens whose
label is not ``IGNORE_INDEX`` (-100; about 10% are ignored), then ``loss.backward()`` into ``hidden.grad``
and ``weight.grad``. The cases differ only in how they get there, which is what the table compares:

=====================  ======================================================================
``plain``              ``F.cross_entropy`` on the full fp32 logits; every ratio refers to it
``cp_allgather``       logits all-gathered over a simulated CP group of ``--cp`` ranks, then CE
``chunked_cat``        per-chunk ``F.cross_entropy`` on ``logits[chunk].float()``, list + ``torch.cat``
``torch_lce[...]``     ``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13), per chunking option
``megatron_vocab_ce``  Megatron-core ``vocab_parallel_cross_entropy`` with TP = 1 on [S, B, V] logits
``liger_flce``         Liger-Kernel ``LigerFusedLinearCrossEntropyLoss`` (CUDA only)
``cce``                cut-cross-entropy ``linear_cross_entropy`` (Apple's CCE; CUDA only)
``ours_*``             ``lightning_cp.ops``: fused head + loss (``ours_lce``: the backend ``impl="auto"``
                       picks, Triton on CUDA; or torch / Triton forced), loss from logits,
                       per-token log-probabilities, and with the entropy of reinforcement learning
=====================  ======================================================================

Each case runs in a fresh worker process (``_harness``), which measures per repetition (``_probes``) the
peak extra memory of forward + backward, minus the gradients the backward leaves behind
(``hidden.grad``, ``weight.grad``: every implementation must produce them, so they are not its cost), its
wall time and its CPU time; the reported peak is the largest over ``--repeat`` repetitions after
``--warmup``, the times their medians. ``--max-mem-gib`` is a budget for the whole worker: a case whose
estimate exceeds it is skipped, and a worker that still outgrows it fails its allocations and is
reported as OOM. A case whose loss differs from ``plain``'s is flagged in the status column.

Run from the repository root::

    python benchmarks/loss_memory.py --quick
    python benchmarks/loss_memory.py --tokens 4096 --vocab 32000 128256 --hidden 1024 \\
        --repeat 1 --warmup 0 --max-mem-gib 16 --json loss_memory.json
    python benchmarks/loss_memory.py --list-cases
    python benchmarks/loss_memory.py --cases plain 'torch_lce*' 'ours_*'
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _harness import (
    DTYPES,
    Case,
    needs_cuda,
    needs_module,
    parse_arguments,
    run_case,
    run_grid,
    start,
)
from _probes import GIB, MIB, measure, set_memory_budget
from _report import (
    CASE,
    STATUS,
    Column,
    add_ratios,
    baseline_rows,
    measurement_columns,
    publish,
    ratio_column,
    shape_column,
)
from torch import Tensor

from lightning_cp.constants import IGNORE_INDEX

IGNORED_FRACTION = 0.1
"""Share of labels set to ``IGNORE_INDEX``, like padding and prompt tokens in a real batch."""

DEFAULT_CHUNK_ROWS = 1024
"""Rows per chunk of the baselines that take an explicit chunk (``chunked_cat``, ``torch_lce[rows]``)
when neither ``--chunk-size`` is given nor ``lightning_cp.ops`` can say which chunk it would pick."""

_RUNTIME_OVERHEAD_BYTES = 1 * GIB
"""Interpreter, torch, Megatron and thread-pool memory of a worker, added to every estimate."""
_LOSS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
"""How far a case's loss may be from ``plain``'s before the table flags it (low-precision cases
compute the softmax from rounded logits)."""
_PACKAGES = ("megatron-core", "triton", "liger-kernel", "cut-cross-entropy")
"""Whose versions the JSON report records."""

_QUICK = {"tokens": [512], "vocab": [4096], "hidden": [256], "chunk_size": 128, "repeat": 1, "warmup": 1}
_FULL_CPU = {"tokens": [4096, 16384], "vocab": [32000, 128256, 151936], "hidden": [1024, 4096]}
_FULL_CUDA = {"tokens": [4096, 16384, 65536], "vocab": [32000, 128256, 151936], "hidden": [1024, 4096]}


# --------------------------------------------------------------------------------------------------
# The problem every case solves, and its sizes


@dataclass(frozen=True)
class Shape:
    """One point of the grid: ``hidden`` is [N, H], ``weight`` [V, H], the logits [N, V]."""

    tokens: int
    """N: rows of ``hidden`` (tokens on this rank)."""
    vocab: int
    """V: rows of ``weight``."""
    hidden: int
    """H: columns of ``hidden`` and ``weight``."""

    def label(self) -> str:
        return f"{self.tokens}x{self.vocab}x{self.hidden}"


@dataclass(frozen=True)
class _Problem:
    hidden: Tensor
    """[N, H], ``--dtype``, requires grad."""
    weight: Tensor
    """[V, H], ``--dtype``, requires grad."""
    labels: Tensor
    """[N] int64, ``IGNORE_INDEX`` on about ``IGNORED_FRACTION`` of the rows."""
    cp: int
    """Size of the simulated CP group of ``cp_allgather``."""
    chunk_size: int | None
    """``--chunk-size`` as given: ``None`` lets ``lightning_cp.ops`` pick its own."""
    chunk_rows: int
    """Rows per chunk of the baselines that take an explicit chunk: the same as ours (see ``_chunk_rows``)."""


def _make_problem(
    shape: Shape, dtype: torch.dtype, device: torch.device, cp: int, chunk_size: int | None, chunk_rows: int
) -> _Problem:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device=device, dtype=dtype)
    # 1/sqrt(H) keeps the logits O(1), as in a trained head, so the softmax is not one-hot.
    weight = (torch.randn(shape.vocab, shape.hidden, generator=gen) / shape.hidden**0.5).to(device, dtype)
    labels = torch.randint(0, shape.vocab, (shape.tokens,), generator=gen)
    labels[torch.rand(shape.tokens, generator=gen) < IGNORED_FRACTION] = IGNORE_INDEX
    return _Problem(
        hidden=hidden.requires_grad_(),
        weight=weight.requires_grad_(),
        labels=labels.to(device),
        cp=cp,
        chunk_size=chunk_size,
        chunk_rows=chunk_rows,
    )


@dataclass(frozen=True)
class _Sizes:
    """Byte counts the memory estimates are written in."""

    logits32: int
    """One [N, V] fp32 tensor."""
    logits: int
    """One [N, V] tensor in ``--dtype``."""
    chunk32: int
    """One [chunk_rows, V] fp32 tensor."""
    weight32: int
    """One [V, H] fp32 tensor."""
    cp: int

    @staticmethod
    def of(shape: Shape, dtype: torch.dtype, cp: int, chunk_rows: int) -> _Sizes:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return _Sizes(
            logits32=shape.tokens * shape.vocab * 4,
            logits=shape.tokens * shape.vocab * itemsize,
            chunk32=chunk_rows * shape.vocab * 4,
            weight32=shape.vocab * shape.hidden * 4,
            cp=cp,
        )

    @property
    def upcast32(self) -> int:
        """The fp32 copy ``.float()`` makes of [N, V] logits; none when they already are fp32."""
        return 0 if self.logits == self.logits32 else self.logits32


# --------------------------------------------------------------------------------------------------
# The cases. Each ``build`` returns a closure computing the scalar loss whose ``backward`` fills
# ``hidden.grad`` and ``weight.grad``; ``estimate`` is a rough upper bound of the peak extra bytes.


def _valid_mean(per_token: Tensor, labels: Tensor) -> Tensor:
    """Mean of a [N] per-token loss over the rows whose label is not ignored (the CE "mean")."""
    valid = labels != IGNORE_INDEX
    return (per_token * valid).sum() / valid.sum()


def _build_plain(p: _Problem) -> Callable[[], Tensor]:
    def step() -> Tensor:
        logits = p.hidden @ p.weight.t()
        return F.cross_entropy(logits.float(), p.labels, ignore_index=IGNORE_INDEX)

    return step


class _SimulatedCPAllGather(torch.autograd.Function):
    """What ``all_gather_into_tensor`` over a CP group of ``cp`` ranks allocates, in one process.

    Forward fills a [cp*N, V] buffer: this rank's slot with its own logits and the ``cp - 1`` peers'
    slots with a copy of them, standing in for the rows the collective would receive (same size,
    same writes, no communication). Backward returns this rank's [N, V] slice as a new tensor, which
    is what the reduce-scatter that is all-gather's backward would allocate (the sum over peers, a
    communication, is not simulated).
    """

    @staticmethod
    def forward(ctx: Any, local: Tensor, cp: int) -> Tensor:
        ctx.rows = local.shape[0]
        gathered = local.new_empty(cp * local.shape[0], local.shape[1])
        for slot in gathered.split(local.shape[0]):
            slot.copy_(local)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad_gathered: Tensor) -> tuple[Tensor, None]:
        return grad_gathered[: ctx.rows].clone(), None


def _build_cp_allgather(p: _Problem) -> Callable[[], Tensor]:
    # Every rank of the CP group computes the loss of the whole gathered sequence; with the peers'
    # rows a copy of this rank's, that loss equals plain's, which the table's loss check relies on.
    gathered_labels = p.labels.repeat(p.cp)

    def step() -> Tensor:
        logits = p.hidden @ p.weight.t()
        gathered = _SimulatedCPAllGather.apply(logits, p.cp)
        return F.cross_entropy(gathered.float(), gathered_labels, ignore_index=IGNORE_INDEX)

    return step


def _build_chunked_cat(p: _Problem) -> Callable[[], Tensor]:
    def step() -> Tensor:
        logits = p.hidden @ p.weight.t()
        per_chunk = [
            F.cross_entropy(rows.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
            for rows, labels in zip(logits.split(p.chunk_rows), p.labels.split(p.chunk_rows))
        ]
        return _valid_mean(torch.cat(per_chunk), p.labels)

    return step


_TORCH_LCE_OPTIONS: dict[str, tuple[str, Callable[[_Problem], dict[str, Any] | None]]] = {
    "torch_lce[no_options]": ("options=None: the unchunked reference path", lambda p: None),
    "torch_lce[auto]": ("LinearCrossEntropyOptions(): chunking and policy per device, dtype", lambda p: {}),
    "torch_lce[aspect_ratio]": (
        "chunking_method='aspect_ratio'",
        lambda p: {"chunking_method": "aspect_ratio"},
    ),
    "torch_lce[aspect_ratio:4]": (
        "chunking_method='aspect_ratio:4'",
        lambda p: {"chunking_method": "aspect_ratio:4"},
    ),
    "torch_lce[rows]": (
        "batch_chunk_size = ours' chunk (or --chunk-size), chunking_method=None",
        lambda p: {"chunking_method": None, "batch_chunk_size": p.chunk_rows},
    ),
    "torch_lce[auto,accurate]": (
        "acc_policy='accurate', default chunking",
        lambda p: {"acc_policy": "accurate"},
    ),
    "torch_lce[auto,balanced]": (
        "acc_policy='balanced', default chunking",
        lambda p: {"acc_policy": "balanced"},
    ),
}
"""Description and ``LinearCrossEntropyOptions`` keyword arguments of each ``torch_lce`` case."""


def _torch_lce_builder(name: str) -> Callable[[_Problem], Callable[[], Tensor]]:
    def build(p: _Problem) -> Callable[[], Tensor]:
        kwargs = _TORCH_LCE_OPTIONS[name][1](p)
        options = None if kwargs is None else torch.nn.LinearCrossEntropyOptions(**kwargs)

        def step() -> Tensor:
            return F.linear_cross_entropy(
                p.hidden, p.weight, p.labels, ignore_index=IGNORE_INDEX, options=options
            )

        return step

    return build


@contextlib.contextmanager
def _megatron_tp1() -> Iterator[None]:
    """A one-process gloo world with Megatron's groups, which ``vocab_parallel_cross_entropy`` reads."""
    import torch.distributed as dist

    from lightning_cp.parallel import groups

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups.initialize(tp=1, cp=1)
    try:
        yield
    finally:
        groups.destroy()
        dist.destroy_process_group()


def _build_megatron(p: _Problem) -> Callable[[], Tensor]:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # Megatron has no ignore_index: models pass a loss mask and any in-vocab label where it is 0.
    target = p.labels.clamp(min=0).view(-1, 1)

    def step() -> Tensor:
        logits = (p.hidden @ p.weight.t()).view(p.hidden.shape[0], 1, -1)  # [S, B=1, V]
        return _valid_mean(vocab_parallel_cross_entropy(logits, target).view(-1), p.labels)

    return step


def _build_liger(p: _Problem) -> Callable[[], Tensor]:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="mean")
    return lambda: loss_fn(p.weight, p.hidden, p.labels)  # Liger takes the weight first


def _build_cce(p: _Problem) -> Callable[[], Tensor]:
    from cut_cross_entropy import linear_cross_entropy

    # CCE's embeddings ``e`` are [..., H] and its classifier ``c`` is [V, H], like ours; "mean" averages
    # over the non-ignored labels. impl="cce" with its default gradient filtering is what users get.
    return lambda: linear_cross_entropy(
        p.hidden, p.weight, p.labels, ignore_index=IGNORE_INDEX, reduction="mean", impl="cce"
    )


def _ours_lce_builder(impl: str) -> Callable[[_Problem], Callable[[], Tensor]]:
    def build(p: _Problem) -> Callable[[], Tensor]:
        from lightning_cp.ops import linear_cross_entropy

        return lambda: linear_cross_entropy(
            p.hidden, p.weight, p.labels, ignore_index=IGNORE_INDEX, chunk_size=p.chunk_size, impl=impl
        )

    return build


def _build_ours_ce(p: _Problem) -> Callable[[], Tensor]:
    from lightning_cp.ops import cross_entropy

    return lambda: cross_entropy(
        p.hidden @ p.weight.t(), p.labels, ignore_index=IGNORE_INDEX, chunk_size=p.chunk_size
    )


def _build_ours_logprobs(p: _Problem) -> Callable[[], Tensor]:
    from lightning_cp.ops import token_logprobs

    def step() -> Tensor:
        logprobs = token_logprobs(
            p.hidden, p.weight, p.labels, ignore_index=IGNORE_INDEX, chunk_size=p.chunk_size
        )
        return _valid_mean(-logprobs, p.labels)

    return step


def _build_ours_logprobs_entropy(p: _Problem) -> Callable[[], Tensor]:
    from lightning_cp.ops import token_logprobs_with_entropy

    def step() -> Tensor:
        logprobs, entropy = token_logprobs_with_entropy(
            p.hidden, p.weight, p.labels, ignore_index=IGNORE_INDEX, chunk_size=p.chunk_size
        )
        # The entropy goes through the backward with a weight of 0: the memory of an entropy bonus, plain's loss.
        return _valid_mean(-logprobs, p.labels) + 0.0 * entropy.sum()

    return step


def _needs_torch_lce(device: torch.device) -> str | None:
    return None if hasattr(F, "linear_cross_entropy") else f"needs torch>=2.13 (have {torch.__version__})"


def _needs_ours(device: torch.device) -> str | None:
    try:
        from lightning_cp.ops import cross_entropy, linear_cross_entropy, token_logprobs  # noqa: F401
    except ImportError as err:
        return f"lightning_cp.ops not importable ({err})"
    return None


@dataclass(frozen=True)
class _LossCase(Case[_Problem, _Sizes]):
    chunk_ref: bool = False
    """Whether the table compares the peak to one chunk of fp32 logits: ours with the [N, V] logits
    never materialized, whose chunk the worker records as it is resolved (``chunk_used``)."""


_CASES: tuple[_LossCase, ...] = (
    _LossCase(
        "plain",
        "F.cross_entropy on full fp32 logits (the baseline)",
        _build_plain,
        lambda s: 3 * s.logits32 + s.upcast32,
    ),
    _LossCase(
        "cp_allgather",
        "logits all-gathered over a simulated CP group, then F.cross_entropy",
        _build_cp_allgather,
        lambda s: s.logits + s.cp * (2 * s.logits32 + s.upcast32) + s.logits32,
    ),
    _LossCase(
        "chunked_cat",
        "per-chunk F.cross_entropy on logits[chunk].float(), list + torch.cat",
        _build_chunked_cat,
        lambda s: s.logits + s.logits32 + s.upcast32 + 2 * s.chunk32,
    ),
    *(
        _LossCase(
            name,
            f"F.linear_cross_entropy, {_TORCH_LCE_OPTIONS[name][0]}",
            _torch_lce_builder(name),
            # The unchunked path materializes logits; the chunked ones a chunk and a [V, H] scratch.
            (lambda s: 2 * s.logits + s.logits32)
            if name == "torch_lce[no_options]"
            else (lambda s: 2 * s.chunk32 + 2 * s.weight32),
            needs=(_needs_torch_lce,),
        )
        for name in _TORCH_LCE_OPTIONS
    ),
    _LossCase(
        "megatron_vocab_ce",
        "megatron.core vocab_parallel_cross_entropy, TP=1, [S,B,V] logits",
        _build_megatron,
        lambda s: s.logits32 + s.upcast32 + s.logits,
        needs=(needs_module("megatron.core", "megatron-core"),),
        context=_megatron_tp1,
    ),
    _LossCase(
        "liger_flce",
        "Liger-Kernel LigerFusedLinearCrossEntropyLoss",
        _build_liger,
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=(needs_cuda, needs_module("liger_kernel", "liger-kernel")),
    ),
    _LossCase(
        "cce",
        "cut-cross-entropy linear_cross_entropy, impl='cce' (default gradient filtering)",
        _build_cce,
        # No [N, V] block at all: per-token statistics, a [V] logit average for the gradient filter and
        # the kernels' scratch; a [V, H] fp32 copy covers them with margin.
        lambda s: s.chunk32 + s.weight32,
        needs=(needs_cuda, needs_module("cut_cross_entropy", "cut-cross-entropy")),
    ),
    _LossCase(
        "ours_lce",
        "lightning_cp.ops.linear_cross_entropy, impl='auto' (Triton on CUDA, torch elsewhere)",
        _ours_lce_builder("auto"),
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=(_needs_ours,),
        chunk_ref=True,
    ),
    _LossCase(
        "ours_lce_torch",
        "lightning_cp.ops.linear_cross_entropy, impl='torch'",
        _ours_lce_builder("torch"),
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=(_needs_ours,),
        chunk_ref=True,
    ),
    _LossCase(
        "ours_lce_triton",
        "lightning_cp.ops.linear_cross_entropy, impl='triton'",
        _ours_lce_builder("triton"),
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=(needs_cuda, _needs_ours),
        chunk_ref=True,
    ),
    _LossCase(
        "ours_ce",
        "lightning_cp.ops.cross_entropy from logits",
        _build_ours_ce,
        lambda s: 2 * s.logits + 3 * s.chunk32,
        needs=(_needs_ours,),
    ),
    _LossCase(
        "ours_logprobs",
        "lightning_cp.ops.token_logprobs, loss = -mean logprob",
        _build_ours_logprobs,
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=(_needs_ours,),
        chunk_ref=True,
    ),
    _LossCase(
        "ours_logprobs_entropy",
        "lightning_cp.ops.token_logprobs_with_entropy (an RL policy loss's pass), entropy back-propagated",
        _build_ours_logprobs_entropy,
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=(_needs_ours,),
        chunk_ref=True,
    ),
)
_CASES_BY_NAME = {case.name: case for case in _CASES}


# --------------------------------------------------------------------------------------------------
# The worker: one case, one shape, in its own process


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one case on one shape as ``spec`` says (see ``_measure_case``); its row's measurements."""
    case = _CASES_BY_NAME[spec["case"]]
    device = torch.device(spec["device"])
    p = _make_problem(
        Shape(**spec["shape"]),
        DTYPES[spec["dtype"]],
        device,
        spec["cp"],
        spec["chunk_size"],
        spec["chunk_rows"],
    )

    def reset() -> None:
        p.hidden.grad = p.weight.grad = None

    def grad_bytes() -> int:
        return sum(t.grad.nbytes for t in (p.hidden, p.weight) if t.grad is not None)

    chunks: list[int] = []
    with case.context(), _recording_chunks(chunks):
        step = case.build(p)

        def forward_backward() -> Tensor:
            loss = step()
            loss.backward()
            return loss.detach()

        set_memory_budget(device, int(spec["max_mem_gib"] * GIB))
        measurement, loss = measure(
            forward_backward,
            device,
            warmup=spec["warmup"],
            repeat=spec["repeat"],
            reset=reset,
            retained=grad_bytes,
        )
    if p.hidden.grad is None or p.weight.grad is None:
        raise RuntimeError(f"case {case.name} left no gradient for hidden or weight")
    result = {"status": "ok", **measurement.summary(), "loss": loss.item()}
    if case.chunk_ref and chunks:
        # The chunk ours resolved in the run (on CUDA the automatic one follows the free memory): the largest.
        result["chunk_used"] = max(chunks)
        result["chunks_used"] = sorted(set(chunks))
    return result


@contextlib.contextmanager
def _recording_chunks(chunks: list[int]) -> Iterator[None]:
    """Append to ``chunks`` the tokens per chunk of every loss ``lightning_cp.ops`` plans meanwhile: the chunk
    each call resolved and used (``chunk_size=None``: the automatic one, at the call), not one asked again."""
    try:
        from lightning_cp.ops._plan import Plan
    except ImportError:  # a case without lightning_cp.ops: nothing to record
        yield
        return
    build = vars(Plan)["build"]

    def recording(cls: type[Plan], **options: Any) -> Plan:
        plan = build.__func__(cls, **options)
        chunks.append(plan.chunk_size)
        return plan

    Plan.build = classmethod(recording)
    try:
        yield
    finally:
        Plan.build = build


# --------------------------------------------------------------------------------------------------
# The parent: grid, estimates, rows, report


def _input_bytes(shape: Shape, dtype: torch.dtype) -> int:
    """Inputs, weight and labels, plus the gradients of the first two."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * (shape.tokens + shape.vocab) * shape.hidden * itemsize + 8 * shape.tokens


def _chunk_reference_bytes(shape: Shape, chunk_rows: int) -> int:
    """One [chunk, V] fp32 logits block plus fp32 per-token statistics (max, sum of exp, target
    logit, loss) for all N tokens: the least a chunked fused head + loss must hold at once."""
    return chunk_rows * shape.vocab * 4 + 4 * 4 * shape.tokens


def _chunk_rows(shape: Shape, chunk_size: int | None) -> int:
    """Rows per chunk of the baselines that take an explicit chunk.

    ``--chunk-size`` when given. Else ours' automatic chunk on the CPU, asked through the engine's helper
    (on CUDA ours' own follows the free memory of its worker, which records the chunk it used: the table's
    ``chunk used``). Without ``lightning_cp.ops`` the baselines fall back to ``DEFAULT_CHUNK_ROWS``.
    """
    if chunk_size is not None:
        return min(chunk_size, shape.tokens)
    try:
        from lightning_cp.ops._plan import auto_chunk_size
    except ImportError:
        return min(DEFAULT_CHUNK_ROWS, shape.tokens)
    return auto_chunk_size(shape.tokens, shape.vocab)


def _measure_case(shape: Shape, case: _LossCase, args: argparse.Namespace) -> dict[str, Any]:
    """One row of the table: ``case`` on ``shape`` in a worker, or why it did not run."""
    dtype = DTYPES[args.dtype]
    chunk_rows = _chunk_rows(shape, args.chunk_size)
    sizes = _Sizes.of(shape, dtype, args.cp, chunk_rows)
    estimate = _input_bytes(shape, dtype) + case.estimate(sizes) + _RUNTIME_OVERHEAD_BYTES
    row: dict[str, Any] = {
        "case": case.name,
        "description": case.description,
        "shape": shape.label(),
        **asdict(shape),
        "dtype": args.dtype,
        "device": args.device.type,
        "estimate_bytes": estimate,
        "chunk_rows": chunk_rows,
        "chunk_ref_bytes": None,
    }
    spec = {
        "shape": asdict(shape),
        "dtype": args.dtype,
        "cp": args.cp,
        "chunk_size": args.chunk_size,
        "chunk_rows": chunk_rows,
    }
    result = run_case(Path(__file__), case, args, spec, estimate)
    if "chunk_used" in result:
        row["chunk_ref_bytes"] = _chunk_reference_bytes(shape, result["chunk_used"])
    return {**row, **result}


def _check_against_plain(rows: list[dict[str, Any]], dtype: torch.dtype) -> None:
    """Add the ratios to ``plain`` of the same shape and to the one-chunk reference, and flag losses
    that disagree with ``plain``'s."""
    add_ratios(rows, "plain")
    plain = baseline_rows(rows, "plain")
    for row in rows:
        ok = row["status"] == "ok"
        ref = row["chunk_ref_bytes"]
        row["ref_ratio"] = row["peak_extra_bytes"] / ref if ok and ref else None
        base = plain.get(row["shape"])
        if ok and base and abs(row["loss"] - base["loss"]) > _LOSS_RTOL[dtype] * abs(base["loss"]):
            row["status"] = f"ok, but loss {row['loss']:.6g} != plain {base['loss']:.6g}"


_COLUMNS = (
    CASE,
    shape_column("N x V x H"),
    *measurement_columns("x plain"),
    Column("chunk used", "chunk_used", ",.0f"),
    Column("1-chunk ref MiB", "chunk_ref_bytes", ",.0f", scale=MIB),
    ratio_column("ref_ratio", "x ref"),
    STATUS,
)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", help="N values (default: 4096 16384, more on CUDA)")
    parser.add_argument("--vocab", type=int, nargs="+", help="V values (default: 32000 128256 151936)")
    parser.add_argument("--hidden", type=int, nargs="+", help="H values (default: 1024 4096)")
    parser.add_argument(
        "--cp", type=int, default=2, help="size of the simulated CP group of cp_allgather (default 2)"
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        help="rows per chunk of ours and of the chunked baselines (default: lightning_cp.ops's own pick)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 512 tokens x 4096 vocab x 256 hidden, chunk 128, 1 run (about a minute on 2 cores)",
    )
    positive = ("cp", "chunk_size", "tokens", "vocab", "hidden")
    return parse_arguments(parser, argv, cpu=_FULL_CPU, cuda=_FULL_CUDA, quick=_QUICK, positive=positive)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid, print the table and return its rows (also written to ``--json``, ``--markdown``)."""
    args = _parse_args(argv)
    cases = start(args, _CASES, _measure)
    if cases is None:
        return []

    shapes = [Shape(n, v, h) for n in args.tokens for v in args.vocab for h in args.hidden]
    started = time.perf_counter()
    rows = run_grid(shapes, cases, lambda shape, case: _measure_case(shape, case, args))
    _check_against_plain(rows, DTYPES[args.dtype])
    wall_s = time.perf_counter() - started

    publish(
        rows,
        _COLUMNS,
        args=args,
        title=(
            f"LM head + cross-entropy, forward + backward, {args.dtype} on {args.device.type}, "
            f"{IGNORED_FRACTION:.0%} of labels ignored, cp={args.cp}, "
            f"time: median of {args.repeat} after {args.warmup} warm-up"
        ),
        notes="1-chunk ref: one [chunk, V] fp32 logits block + 4 fp32 statistics per token; x ref: peak / ref.",
        wall_s=wall_s,
        packages=_PACKAGES,
    )
    return rows


if __name__ == "__main__":
    main()
