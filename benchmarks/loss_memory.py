"""Peak memory and time of LM-head + cross-entropy implementations, side by side in one run.

Every case computes the same thing: ``loss = mean CE(hidden @ weight.T, labels)`` over the tokens whose
label is not ``-100`` (about 10% are ignored), then ``loss.backward()`` into ``hidden.grad`` and
``weight.grad``. The cases differ only in how they get there, which is what the table compares:

=====================  ======================================================================
``plain``              ``F.cross_entropy`` on the full fp32 logits; every ratio refers to it
``cp_allgather``       logits all-gathered over a simulated CP group of ``--cp`` ranks, then CE
``chunked_cat``        per-chunk ``F.cross_entropy`` on ``logits[chunk].float()``, list + ``torch.cat``
``torch_lce[...]``     ``torch.nn.functional.linear_cross_entropy`` (torch >= 2.13), per chunking option
``megatron_vocab_ce``  Megatron-core ``vocab_parallel_cross_entropy`` with TP = 1 on [S, B, V] logits
``liger_flce``         Liger-Kernel ``LigerFusedLinearCrossEntropyLoss`` (CUDA only)
``ours_*``             ``lightning_cp.ops``: fused head + loss (torch / Triton), loss from logits,
                       per-token log-probabilities
=====================  ======================================================================

Each case runs in a fresh subprocess (this file with ``--worker``), so one case's allocator caches,
one-time workspaces and crashes cannot leak into the next. What is measured, per repetition:

- peak extra memory: the high-water mark during forward + backward, minus what was allocated just
  before the forward (inputs, weight, labels), minus the gradients the backward leaves behind
  (``hidden.grad``, ``weight.grad``: every implementation must produce them, so they are not its cost).
  On CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. On CPU: the process's
  resident set (``VmHWM`` in ``/proc/self/status``), whose high-water mark is reset before each
  repetition by writing ``5`` to ``/proc/self/clear_refs``; the worker runs with a fixed glibc mmap
  threshold so that freed tensors leave the resident set instead of sitting in malloc's free lists.
- time: wall-clock forward + backward (CUDA synchronized), median of ``--repeat`` runs after
  ``--warmup`` runs; and the CPU time of the worker process over the same span (all threads), which
  on a CPU shared with other jobs is far steadier than wall time (on CUDA it is mostly launch
  overhead and waiting).

The reported peak is the largest over the repetitions. ``--max-mem-gib`` is a budget for the whole
worker process: a case whose estimate exceeds it is skipped with the estimate, and a worker that
still outgrows it (the estimates are rough) fails its allocation (CPU: ``RLIMIT_AS``; CUDA:
``set_per_process_memory_fraction``) and is reported as OOM instead of taking the machine down.

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
import fnmatch
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
IGNORED_FRACTION = 0.1
"""Share of labels set to ``IGNORE_INDEX``, like padding and prompt tokens in a real batch."""

DEFAULT_CHUNK_ROWS = 1024
"""Rows per chunk of the baselines that take an explicit chunk (``chunked_cat``, ``torch_lce[rows]``)
when neither ``--chunk-size`` is given nor ``lightning_cp.ops`` can say which chunk it would pick."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_MIB = 2**20
_GIB = 2**30
_RUNTIME_OVERHEAD_BYTES = 1 * _GIB
"""Interpreter, torch, Megatron and thread-pool memory of a worker, added to every estimate."""
_MALLOC_MMAP_THRESHOLD = 128 * 1024
"""Setting the threshold turns off glibc's dynamic threshold, under which freed blocks up to 32 MiB
stay resident in malloc's free lists and hide later allocations from the RSS measurement."""
_LOSS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
"""How far a case's loss may be from ``plain``'s before the table flags it (low-precision cases
compute the softmax from rounded logits)."""

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
    return lambda: loss_fn(p.weight, p.hidden, p.labels)


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


@dataclass(frozen=True)
class _Case:
    name: str
    description: str
    build: Callable[[_Problem], Callable[[], Tensor]]
    estimate: Callable[[_Sizes], int]
    """Rough upper bound of the peak extra bytes (what the table measures), for ``--max-mem-gib``."""
    needs: frozenset[str] = frozenset()
    """Of ``cuda``, ``torch_lce``, ``megatron``, ``liger``, ``ours``: checked before a worker starts."""
    context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    """Process-wide setup the case needs around its steps (runs in the worker, not timed)."""
    chunk_ref: bool = False
    """Whether the table compares the peak to one chunk of fp32 logits: ours with the [N, V] logits
    never materialized, whose chunk is ``_chunk_rows``."""


_CASES: tuple[_Case, ...] = (
    _Case(
        "plain",
        "F.cross_entropy on full fp32 logits (the baseline)",
        _build_plain,
        lambda s: 3 * s.logits32 + s.upcast32,
    ),
    _Case(
        "cp_allgather",
        "logits all-gathered over a simulated CP group, then F.cross_entropy",
        _build_cp_allgather,
        lambda s: s.logits + s.cp * (2 * s.logits32 + s.upcast32) + s.logits32,
    ),
    _Case(
        "chunked_cat",
        "per-chunk F.cross_entropy on logits[chunk].float(), list + torch.cat",
        _build_chunked_cat,
        lambda s: s.logits + s.logits32 + s.upcast32 + 2 * s.chunk32,
    ),
    *(
        _Case(
            name,
            f"F.linear_cross_entropy, {_TORCH_LCE_OPTIONS[name][0]}",
            _torch_lce_builder(name),
            # The unchunked path materializes logits; the chunked ones a chunk and a [V, H] scratch.
            (lambda s: 2 * s.logits + s.logits32)
            if name == "torch_lce[no_options]"
            else (lambda s: 2 * s.chunk32 + 2 * s.weight32),
            needs=frozenset({"torch_lce"}),
        )
        for name in _TORCH_LCE_OPTIONS
    ),
    _Case(
        "megatron_vocab_ce",
        "megatron.core vocab_parallel_cross_entropy, TP=1, [S,B,V] logits",
        _build_megatron,
        lambda s: s.logits32 + s.upcast32 + s.logits,
        needs=frozenset({"megatron"}),
        context=_megatron_tp1,
    ),
    _Case(
        "liger_flce",
        "Liger-Kernel LigerFusedLinearCrossEntropyLoss",
        _build_liger,
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=frozenset({"liger", "cuda"}),
    ),
    _Case(
        "ours_lce_torch",
        "lightning_cp.ops.linear_cross_entropy, impl='torch'",
        _ours_lce_builder("torch"),
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=frozenset({"ours"}),
        chunk_ref=True,
    ),
    _Case(
        "ours_lce_triton",
        "lightning_cp.ops.linear_cross_entropy, impl='triton'",
        _ours_lce_builder("triton"),
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=frozenset({"ours", "cuda"}),
        chunk_ref=True,
    ),
    _Case(
        "ours_ce",
        "lightning_cp.ops.cross_entropy from logits",
        _build_ours_ce,
        lambda s: 2 * s.logits + 3 * s.chunk32,
        needs=frozenset({"ours"}),
    ),
    _Case(
        "ours_logprobs",
        "lightning_cp.ops.token_logprobs, loss = -mean logprob",
        _build_ours_logprobs,
        lambda s: 3 * s.chunk32 + s.weight32,
        needs=frozenset({"ours"}),
        chunk_ref=True,
    ),
)
_CASES_BY_NAME = {case.name: case for case in _CASES}


def _select_cases(patterns: Sequence[str] | None) -> list[_Case]:
    """The cases named by ``patterns``: exact names (which contain ``[``) or shell-style patterns."""
    if not patterns:
        return list(_CASES)

    def hits(pattern: str) -> list[_Case]:
        return [c for c in _CASES if c.name == pattern or fnmatch.fnmatchcase(c.name, pattern)]

    unmatched = [pattern for pattern in patterns if not hits(pattern)]
    if unmatched:
        raise SystemExit(
            f"--cases {' '.join(unmatched)} matches no case; the cases are: {', '.join(_CASES_BY_NAME)} "
            "(shell-style patterns such as 'torch_lce*' work)"
        )
    chosen = {c.name for pattern in patterns for c in hits(pattern)}
    return [c for c in _CASES if c.name in chosen]


def _unavailable(case: _Case, device: torch.device) -> str | None:
    """Why ``case`` cannot run here (the table's status, every missing need), or ``None`` when it can."""
    missing = [reason for need in sorted(case.needs) if (reason := _missing(need, device))]
    return "; ".join(missing) or None


def _missing(need: str, device: torch.device) -> str | None:
    if need == "cuda":
        return None if device.type == "cuda" else "needs CUDA"
    if need == "torch_lce":
        return None if hasattr(F, "linear_cross_entropy") else f"needs torch>=2.13 (have {torch.__version__})"
    if need == "megatron":
        return None if importlib.util.find_spec("megatron.core") else "megatron-core not installed"
    if need == "liger":
        return None if importlib.util.find_spec("liger_kernel") else "liger-kernel not installed"
    if need != "ours":
        raise ValueError(
            f"_Case.needs has {need!r}; the known needs are cuda, torch_lce, megatron, liger, ours"
        )
    try:
        from lightning_cp.ops import cross_entropy, linear_cross_entropy, token_logprobs  # noqa: F401
    except ImportError as err:
        return f"lightning_cp.ops not importable ({err})"
    return None


# --------------------------------------------------------------------------------------------------
# The worker: one case, one shape, in its own process


class _RssProbe:
    """Peak resident memory of this process between ``start`` and ``peak`` (Linux only)."""

    @staticmethod
    def _status_kib(field: str) -> int:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
        if match is None:
            raise RuntimeError(f"/proc/self/status has no {field} line")
        return int(match.group(1)) * 1024

    def start(self) -> int:
        # "5" resets VmHWM to the current VmRSS (Linux >= 4.0), so every repetition gets its own peak.
        Path("/proc/self/clear_refs").write_text("5")
        return self._status_kib("VmRSS")

    def peak(self) -> int:
        return self._status_kib("VmHWM")

    def limit(self, budget_bytes: int) -> None:
        """Fail allocations once the process would grow past ``budget_bytes`` resident."""
        headroom = budget_bytes - self._status_kib("VmRSS")
        if headroom <= 0:
            raise MemoryError(f"the inputs alone exceed --max-mem-gib ({budget_bytes / _GIB:.1f} GiB)")
        soft = self._status_kib("VmSize") + headroom
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(
            resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
        )


class _CudaProbe:
    """Peak CUDA memory allocated by torch between ``start`` and ``peak``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def limit(self, budget_bytes: int) -> None:
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), self.device)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or "allocate memory" in str(err)


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one case on one shape as ``spec`` says and return its measurements."""
    case = _CASES_BY_NAME[spec["case"]]
    device = torch.device(spec["device"])
    shape = Shape(**spec["shape"])
    problem = _make_problem(
        shape, _DTYPES[spec["dtype"]], device, spec["cp"], spec["chunk_size"], spec["chunk_rows"]
    )
    probe = _CudaProbe(device) if device.type == "cuda" else _RssProbe()
    peaks: list[int] = []
    times_ms: list[float] = []
    cpu_ms: list[float] = []
    with case.context():
        step = case.build(problem)
        probe.limit(int(spec["max_mem_gib"] * _GIB))
        for rep in range(spec["warmup"] + spec["repeat"]):
            problem.hidden.grad = problem.weight.grad = None
            gc.collect()
            base = probe.start()
            begin, begin_cpu = time.perf_counter(), time.process_time()
            loss = step()
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed, elapsed_cpu = time.perf_counter() - begin, time.process_time() - begin_cpu
            grads = sum(t.grad.nbytes for t in (problem.hidden, problem.weight) if t.grad is not None)
            if rep >= spec["warmup"]:
                peaks.append(probe.peak() - base - grads)
                times_ms.append(elapsed * 1e3)
                cpu_ms.append(elapsed_cpu * 1e3)
            loss_value = loss.item()
            del loss
    if problem.hidden.grad is None or problem.weight.grad is None:
        raise RuntimeError(f"case {case.name} left no gradient for hidden or weight")
    return {
        "status": "ok",
        "peak_extra_bytes": max(peaks),
        "peak_extra_bytes_all": peaks,
        "time_ms": statistics.median(times_ms),
        "times_ms": times_ms,
        "cpu_ms": statistics.median(cpu_ms),
        "cpu_ms_all": cpu_ms,
        "loss": loss_value,
        "threads": torch.get_num_threads(),
    }


def _worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    try:
        result = _measure(spec)
    except Exception as err:  # noqa: BLE001  (any failure is one row's status; the run goes on)
        result = {"status": "OOM" if _is_oom(err) else f"error: {type(err).__name__}: {err}"[:300]}
    Path(spec["result_path"]).write_text(json.dumps(result))


# --------------------------------------------------------------------------------------------------
# The parent: grid, budget, subprocesses, table, JSON


def _run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec`` in a fresh interpreter; its measurements, or how it died (killed, crashed)."""
    env = dict(os.environ)
    if spec["device"] == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = str(_MALLOC_MMAP_THRESHOLD)
    with tempfile.TemporaryDirectory(prefix="loss_memory_") as tmp:
        result_path = Path(tmp) / "result.json"
        proc = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                json.dumps({**spec, "result_path": str(result_path)}),
            ],
            env=env,
            check=False,
            capture_output=True,
            text=True,
        )
        if result_path.exists():
            return json.loads(result_path.read_text())
    if proc.returncode < 0:
        killed = " (SIGKILL: likely the kernel's OOM killer)" if proc.returncode == -9 else ""
        return {"status": f"died: signal {-proc.returncode}{killed}"}
    last = proc.stderr.strip().splitlines()[-1:] or ["no output"]
    return {"status": f"died: exit {proc.returncode}: {last[0]}"[:300]}


def _input_bytes(shape: Shape, dtype: torch.dtype) -> int:
    """Inputs, weight and labels, plus the gradients of the first two."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * (shape.tokens + shape.vocab) * shape.hidden * itemsize + 8 * shape.tokens


def _chunk_reference_bytes(shape: Shape, chunk_rows: int) -> int:
    """One [chunk, V] fp32 logits block plus fp32 per-token statistics (max, sum of exp, target
    logit, loss) for all N tokens: the least a chunked fused head + loss must hold at once."""
    return chunk_rows * shape.vocab * 4 + 4 * 4 * shape.tokens


def _chunk_rows(shape: Shape, chunk_size: int | None) -> tuple[int, bool]:
    """Rows per chunk of ours for ``shape``, and whether that is known to be ours' chunk.

    ``--chunk-size`` when given; else the chunk ``lightning_cp.ops`` picks itself, which its public
    functions resolve internally (``chunk_size=None``), so it is asked through the engine's helper.
    Without ``lightning_cp.ops`` the baselines fall back to ``DEFAULT_CHUNK_ROWS``.
    """
    if chunk_size is not None:
        return min(chunk_size, shape.tokens), True
    try:
        from lightning_cp.ops._plan import auto_chunk_size
    except ImportError:
        return min(DEFAULT_CHUNK_ROWS, shape.tokens), False
    return auto_chunk_size(shape.tokens, shape.vocab), True


def _machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers depend on: processor, cores, memory, device and library versions."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        cpu = match.group(1) if match else cpu

    def version(dist_name: str) -> str | None:
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / _GIB,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "megatron-core": version("megatron-core"),
        "triton": version("triton"),
        "liger-kernel": version("liger-kernel"),
    }


def _fill_ratios(rows: list[dict[str, Any]], dtype: torch.dtype) -> None:
    """Add the ratios to ``plain`` of the same shape and to the one-chunk reference, and flag losses
    that disagree with ``plain``'s."""
    plain = {r["shape"]: r for r in rows if r["case"] == "plain" and r["status"] == "ok"}
    for row in rows:
        base = plain.get(row["shape"])
        ok = row["status"] == "ok"
        row["mem_ratio"] = row["peak_extra_bytes"] / base["peak_extra_bytes"] if ok and base else None
        row["time_ratio"] = row["time_ms"] / base["time_ms"] if ok and base else None
        row["cpu_ratio"] = row["cpu_ms"] / base["cpu_ms"] if ok and base else None
        ref = row["chunk_ref_bytes"]
        row["ref_ratio"] = row["peak_extra_bytes"] / ref if ok and ref else None
        if ok and base and abs(row["loss"] - base["loss"]) > _LOSS_RTOL[dtype] * abs(base["loss"]):
            row["status"] = f"ok, but loss {row['loss']:.6g} != plain {base['loss']:.6g}"


def _format_table(rows: list[dict[str, Any]]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    header = (
        "case",
        "N x V x H",
        "peak extra MiB",
        "x plain",
        "time ms",
        "x plain",
        "cpu ms",
        "x plain",
        "1-chunk ref MiB",
        "x ref",
        "status",
    )
    lines = [
        (
            r["case"],
            r["shape"],
            num(r.get("peak_extra_bytes") and r["peak_extra_bytes"] / _MIB, ",.0f"),
            num(r["mem_ratio"], ".2f"),
            num(r.get("time_ms"), ",.1f"),
            num(r["time_ratio"], ".2f"),
            num(r.get("cpu_ms"), ",.0f"),
            num(r["cpu_ratio"], ".2f"),
            num(r["chunk_ref_bytes"] and r["chunk_ref_bytes"] / _MIB, ",.0f"),
            num(r["ref_ratio"], ".2f"),
            r["status"],
        )
        for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header))]
    align = ["<", "<", *[">"] * (len(header) - 3), "<"]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(cells) for cells in lines)])


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", help="N values (default: 4096 16384, more on CUDA)")
    parser.add_argument("--vocab", type=int, nargs="+", help="V values (default: 32000 128256 151936)")
    parser.add_argument("--hidden", type=int, nargs="+", help="H values (default: 1024 4096)")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), help="of hidden and weight (default: fp32 on CPU, bf16 on CUDA)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--repeat", type=int, help="timed runs per case; the median is reported (default 3)")
    parser.add_argument("--warmup", type=int, help="untimed runs before them (default 1)")
    parser.add_argument(
        "--cases", nargs="+", metavar="PATTERN", help="shell-style patterns of case names (default: all)"
    )
    parser.add_argument(
        "--cp", type=int, default=2, help="size of the simulated CP group of cp_allgather (default 2)"
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        help="rows per chunk of ours and of the chunked baselines (default: lightning_cp.ops's own pick)",
    )
    parser.add_argument(
        "--max-mem-gib",
        type=float,
        help="memory budget of one case's process (default: 2/3 of RAM or the GPU's memory)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="write every measurement and the machine info here"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 512 tokens x 4096 vocab x 256 hidden, chunk 128, 1 run (about a minute on 2 cores)",
    )
    parser.add_argument("--list-cases", action="store_true", help="print the case names and exit")
    parser.add_argument("--worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    preset = {"repeat": 3, "warmup": 1, **(_FULL_CUDA if args.device.type == "cuda" else _FULL_CPU)}
    if args.quick:
        preset.update(_QUICK)
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("bf16" if args.device.type == "cuda" else "fp32")
    if args.max_mem_gib is None:
        total = (
            torch.cuda.get_device_properties(args.device).total_memory
            if args.device.type == "cuda"
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )
        args.max_mem_gib = round(total * 2 / 3 / _GIB, 1)
    for name in ("repeat", "cp", "chunk_size", "max_mem_gib"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} {value}: must be positive")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: must be >= 0")
    for name in ("tokens", "vocab", "hidden"):
        if any(v <= 0 for v in getattr(args, name)):
            parser.error(f"--{name} {getattr(args, name)}: sizes must be positive")
    return args


def _measure_case(case: _Case, shape: Shape, args: argparse.Namespace) -> dict[str, Any]:
    """One row of the table: ``case`` on ``shape`` in a worker, or why it did not run."""
    dtype = _DTYPES[args.dtype]
    chunk_rows, chunk_is_ours = _chunk_rows(shape, args.chunk_size)
    estimate = (
        _input_bytes(shape, dtype)
        + case.estimate(_Sizes.of(shape, dtype, args.cp, chunk_rows))
        + _RUNTIME_OVERHEAD_BYTES
    )
    row: dict[str, Any] = {
        "case": case.name,
        "description": case.description,
        "shape": shape.label(),
        **asdict(shape),
        "dtype": args.dtype,
        "device": args.device.type,
        "estimate_bytes": estimate,
        "chunk_rows": chunk_rows,
        "chunk_ref_bytes": _chunk_reference_bytes(shape, chunk_rows)
        if case.chunk_ref and chunk_is_ours
        else None,
    }
    reason = _unavailable(case, args.device)
    if reason is None and estimate > args.max_mem_gib * _GIB:
        reason = f"skipped: estimate {estimate / _GIB:.2f} GiB > --max-mem-gib {args.max_mem_gib:g}"
    if reason is not None:
        return {**row, "status": reason}
    spec = {
        "case": case.name,
        "shape": asdict(shape),
        "dtype": args.dtype,
        "device": str(args.device),
        "cp": args.cp,
        "chunk_size": args.chunk_size,
        "chunk_rows": chunk_rows,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "max_mem_gib": args.max_mem_gib,
    }
    return {**row, **_run_worker(spec)}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid, print the table and return its rows (also written to ``--json``)."""
    args = _parse_args(argv)
    if args.worker:
        _worker_main(args.worker)
        return []
    cases = _select_cases(args.cases)
    if args.list_cases:
        print("\n".join(f"{c.name:28} {c.description}" for c in cases))
        return []

    shapes = [Shape(n, v, h) for n in args.tokens for v in args.vocab for h in args.hidden]
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        for case in cases:
            row = _measure_case(case, shape, args)
            rows.append(row)
            ok = row["status"] == "ok"
            done = (
                f"{row['peak_extra_bytes'] / _MIB:,.0f} MiB, {row['time_ms']:,.1f} ms"
                if ok
                else row["status"]
            )
            print(
                f"[{len(rows)}/{len(shapes) * len(cases)}] {case.name} {shape.label()}: {done}",
                file=sys.stderr,
            )
    _fill_ratios(rows, _DTYPES[args.dtype])
    wall_s = time.perf_counter() - started

    print(
        f"\nLM head + cross-entropy, forward + backward, {args.dtype} on {args.device.type}, "
        f"{IGNORED_FRACTION:.0%} of labels ignored, cp={args.cp}, "
        f"time: median of {args.repeat} after {args.warmup} warm-up"
    )
    print(_format_table(rows))
    print("\n1-chunk ref: one [chunk, V] fp32 logits block + 4 fp32 statistics per token; x ref: peak / ref.")
    print(f"wall time {wall_s:.0f} s")
    if args.json:
        report = {
            "machine": _machine_info(args.device),
            "args": {k: str(v) if isinstance(v, (Path, torch.device)) else v for k, v in vars(args).items()},
            "wall_s": wall_s,
            "results": rows,
        }
        args.json.write_text(json.dumps(report, indent=2))
    return rows


if __name__ == "__main__":
    main()
