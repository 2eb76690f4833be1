"""One CP rank of a hybrid (Qwen3.5-shaped) model at long context: Gated DeltaNet and attention, per rank.

A tiny-width model of Qwen3.5's text shape (``model_type="qwen3_5_text"``: three Gated DeltaNet layers to one
attention layer, random weights seeded alike in every worker, ``--dtype`` parameters) runs one training
forward + backward of its decoder body and the fused loss (``lightning_cp.ops.linear_cross_entropy`` on the
LM head's weight, no logits) over one sequence of ``--tokens`` (``padded``) or a row of equal packed documents
(``docs4``):

=============  ========================================================================================
``unsharded``  ``transformers``' own model (``attn_implementation="sdpa"``, its torch Gated DeltaNet
               kernel) on the whole sequence, every document of a packed layout alone (as rows of a
               batch): the baseline every ratio refers to
``cp1``,       rank 0 of a simulated CP group of 1, 2 or 4 ranks, on the package's path: the model built
``cp2``,       with ``attn_implementation="lightning_cp"``, its Gated DeltaNet layers adapted
``cp4``        (``lightning_cp.hf.mixers.adapt_token_mixers``), the batch sharded for the rank
               (``shard_batch``), the decoder called with the shard's ``cp_shard``
=============  ========================================================================================

The peers are simulated (:class:`lightning_cp.parallel.simulated.SimulatedCPGroup`): forward and backward
run inside ``group.recording()``, where every collective of the rank (attention's K/V all-gather and the
reduce-scatter of their gradients, the Gated DeltaNet layers' all-to-all of
``lightning_cp.parallel.head_parallel``) answers with stand-ins of the right shape, the peers' data being
zeros. That changes no byte and no operation of this rank's own work, so its memory and time are what one
rank of a real group spends, less the communication; its loss is not the unsharded loss (the peers' tokens
are zeros), except at cp = 1, where the table flags a loss that differs from ``unsharded``'s. Each
repetition gets a fresh group and a fresh shard of the batch (untimed), as every training step does.

Columns: the rank's local tokens (``seq_len / cp``, padded to ``2 * cp`` chunks), peak extra memory and
time of forward + backward (``_probes``; the parameters' gradients, which every case leaves, are not
counted) over ``unsharded``'s on the same shape, and the ideal share of the memory, ``1 / cp``. Each case
runs in a fresh worker process (``_harness``).

The parent process imports neither ``lightning_cp`` nor ``transformers`` (only the workers do). Run from the
repository root::

    python benchmarks/hybrid.py --quick                         # 512 tokens, 2 layers
    python benchmarks/hybrid.py --markdown hybrid.md            # CPU: 8K and 16K tokens, padded and docs4
    python benchmarks/hybrid.py --tokens 32768 --cases unsharded cp4 --warmup 0
    python benchmarks/hybrid.py --device cuda --tokens 32768 131072   # bf16, padded and docs4
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from _harness import DTYPES, Case, needs_module, parse_arguments, run_case, run_grid, start
from _probes import GIB, MIB, measure, set_memory_budget
from _report import CASE, STATUS, Column, add_ratios, measurement_columns, publish, ratio_column, shape_column
from torch import Tensor

QWEN3_5_TINY = {
    "model_type": "qwen3_5_text",
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,  # fewer key heads than cp = 4: two ranks share each
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
}
"""Qwen3.5's layer pattern (3 Gated DeltaNet layers to 1 attention layer) at width 128; ``--quick`` takes
``tiny``: one layer of each."""
_TINY = {
    **QWEN3_5_TINY,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
}
MODELS = {"qwen3.5-tiny": QWEN3_5_TINY, "tiny": _TINY}
"""The configurations a shape names."""

LAYOUTS = {"padded": 1, "docs4": 4}
"""Layouts of the sequence: how many equal documents it packs (``padded``: one sequence)."""
CP_SIZES = {"unsharded": None, "cp1": 1, "cp2": 2, "cp4": 4}
"""Each case's simulated CP group size (``None``: no CP, ``transformers``' own model)."""
_LOSS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
_PACKAGES = ("transformers", "flash-linear-attention", "causal-conv1d")
_RUNTIME_OVERHEAD_BYTES = GIB
"""The interpreter, torch, transformers and lightning_cp, and the weights of the tiny model."""


@dataclass(frozen=True)
class Shape:
    model: str
    tokens: int
    layout: str = "padded"

    def label(self) -> str:
        return f"{self.layout} T={self.tokens}"

    @property
    def documents(self) -> int:
        return LAYOUTS[self.layout]


def local_tokens(shape: Shape, cp: int | None) -> int:
    """The rank's tokens: each document padded to ``2 * cp`` chunks, divided by ``cp`` (all tokens without CP)."""
    if cp is None:
        return shape.tokens
    lengths = _document_lengths(shape)
    return sum(-(-n // (2 * cp)) * 2 * cp for n in lengths) // cp


def _document_lengths(shape: Shape) -> list[int]:
    n = shape.documents
    return [shape.tokens // n] * (n - 1) + [shape.tokens - (n - 1) * (shape.tokens // n)]


def _config(shape: Shape) -> Any:
    import transformers

    return transformers.AutoConfig.for_model(**MODELS[shape.model])


@dataclass
class _Problem:
    shape: Shape
    cp: int | None
    model: torch.nn.Module
    """``Qwen3_5ForCausalLM`` in training mode: ``sdpa`` attention, or ``lightning_cp`` with adapted mixers."""
    input_ids: Tensor
    """``[1, T]`` random token ids of the whole sequence (the documents one after the other)."""
    before_step: list[Callable[[], None]] = field(default_factory=list)
    """Run before every repetition, untimed (a case's fresh batch)."""


def _make_problem(shape: Shape, cp: int | None, dtype: torch.dtype, device: torch.device) -> _Problem:
    import transformers

    import lightning_cp  # noqa: F401  (registers attn_implementation="lightning_cp")
    from lightning_cp.hf.mixers import adapt_token_mixers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.manual_seed(
        0
    )  # the same weights in every case's worker, so that cp1's loss compares with unsharded's
    attention = "sdpa" if cp is None else "lightning_cp"
    with device:
        model = transformers.AutoModelForCausalLM.from_config(
            _config(shape), attn_implementation=attention, dtype=dtype
        )
    model.train()
    if cp is not None:
        adapt_token_mixers(model, cp)
    vocab = MODELS[shape.model]["vocab_size"]
    ids = torch.randint(vocab, (1, shape.tokens), generator=torch.Generator().manual_seed(0))
    return _Problem(shape, cp, model, ids.to(device))


def _build_unsharded(p: _Problem) -> Callable[[], Tensor]:
    """``transformers``' model on the whole sequence; packed documents each alone, as the rows of a batch."""
    from lightning_cp.constants import IGNORE_INDEX
    from lightning_cp.ops import linear_cross_entropy

    lengths = _document_lengths(p.shape)
    if len(set(lengths)) != 1:
        raise ValueError(
            f"{p.shape.label()}: the unsharded case needs documents of one length, got {lengths}"
        )
    ids = p.input_ids.view(len(lengths), lengths[0])  # [documents, L]
    labels = torch.cat(
        [ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1
    )  # next token in the document
    positions = torch.arange(lengths[0], device=ids.device).expand_as(ids)
    weight = p.model.lm_head.weight

    def step() -> Tensor:
        hidden = p.model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        loss = linear_cross_entropy(hidden.flatten(0, 1), weight, labels.flatten())
        loss.backward()
        return loss.detach()

    return step


def _build_rank(p: _Problem) -> Callable[[], Tensor]:
    """Rank 0 of a simulated group of ``p.cp``: its shard through the package's path, every collective answered
    by stand-ins (``SimulatedCPGroup.recording``)."""
    from lightning_cp.ops import linear_cross_entropy
    from lightning_cp.parallel import shard_batch
    from lightning_cp.parallel.simulated import SimulatedCPGroup

    assert p.cp is not None
    full: dict[str, Tensor] = {"input_ids": p.input_ids}
    if p.shape.documents > 1:
        full["cu_seqlens"] = torch.tensor([0, *_document_lengths(p.shape)], device=p.input_ids.device).cumsum(
            0
        )
    weight = p.model.lm_head.weight
    current: dict[str, Any] = {}

    def new_batch() -> None:
        # A fresh group and shard before every repetition (untimed, as the data pipeline's), as each training
        # step has: what the shard computes lazily (key pieces, sequence order) is then part of every step.
        current.clear()
        group = SimulatedCPGroup(p.cp, sum_key_gradients=False)
        current.update(group=group, batch=shard_batch(full, p.cp, 0, cp_group=group.exchange(0)))

    p.before_step.append(new_batch)

    def step() -> Tensor:
        group, batch = current["group"], current["batch"]
        with group.recording():
            hidden = p.model.model(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                cp_shard=batch["cp_shard"],
                use_cache=False,
            ).last_hidden_state
            loss = linear_cross_entropy(hidden.flatten(0, 1), weight, batch["labels"].flatten())
            loss.backward()
        return loss.detach()

    return step


def _estimate(sizes: tuple[Shape, int, int | None]) -> int:
    """Weights with their gradients, and per layer and local token the activations autograd keeps: the
    projections, the Gated DeltaNet's chunked intermediates (about ``12 * 64`` per value head: its
    ``[64, 64]`` chunk matrices), the MLP; plus one 64 MiB block of the package's CPU attention kernel x 4."""
    shape, itemsize, cp = sizes
    c = MODELS[shape.model]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    value_heads = c["linear_num_value_heads"]
    layer = 4 * hidden**2 + 3 * hidden * inter + 4 * value_heads * c["linear_value_head_dim"] * hidden
    params = c["num_hidden_layers"] * layer + 2 * c["vocab_size"] * hidden
    per_token = c["num_hidden_layers"] * (16 * hidden + 6 * inter + 12 * 64 * value_heads // (cp or 1))
    blocks = 0 if cp is None else 4 * 64 * MIB
    return 2 * params * itemsize + local_tokens(shape, cp) * per_token * itemsize + blocks


_NEEDS = (needs_module("transformers", "transformers"),)
_CASES: tuple[Case[_Problem, tuple[Shape, int, int | None]], ...] = (
    Case(
        "unsharded",
        "transformers' own model (sdpa, torch Gated DeltaNet) on the whole sequence + fused loss: the baseline",
        _build_unsharded,
        _estimate,
        needs=_NEEDS,
    ),
    *(
        Case(
            f"cp{cp}",
            f"rank 0 of a simulated CP group of {cp}: lightning_cp attention, adapted mixers, its shard",
            _build_rank,
            _estimate,
            needs=_NEEDS,
        )
        for cp in (1, 2, 4)
    ),
)
_CASES_BY_NAME = {case.name: case for case in _CASES}


# --------------------------------------------------------------------------------------------------
# The worker


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    case = _CASES_BY_NAME[spec["case"]]
    device = torch.device(spec["device"])
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    p = _make_problem(Shape(**spec["shape"]), CP_SIZES[case.name], DTYPES[spec["dtype"]], device)
    step = case.build(p)
    params = [t for t in p.model.parameters() if t.requires_grad]

    def reset() -> None:
        for t in params:
            t.grad = None
        for hook in p.before_step:
            hook()

    set_memory_budget(device, int(spec["max_mem_gib"] * GIB))
    measurement, loss = measure(
        step,
        device,
        warmup=spec["warmup"],
        repeat=spec["repeat"],
        reset=reset,
        retained=lambda: sum(t.grad.nbytes for t in params if t.grad is not None),
    )
    return {"status": "ok", **measurement.summary(), "loss": loss.float().item()}


# --------------------------------------------------------------------------------------------------
# The parent


def _measure_case(shape: Shape, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    cp = CP_SIZES[case.name]
    itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    estimate = case.estimate((shape, itemsize, cp)) + _RUNTIME_OVERHEAD_BYTES
    row = {
        "case": case.name,
        "shape": shape.label(),
        **asdict(shape),
        "cp": cp,
        "local_tokens": local_tokens(shape, cp),
        "ideal_mem_ratio": 1 / (cp or 1),
        "dtype": args.dtype,
    }
    spec = {"shape": asdict(shape), "dtype": args.dtype, "threads": args.threads}
    return {**row, **run_case(Path(__file__), case, args, spec, estimate)}


def _check_cp1_loss(rows: list[dict[str, Any]], dtype: torch.dtype) -> None:
    """Flag a ``cp1`` loss that differs from ``unsharded``'s on the same shape (the same weights and targets;
    cp2 and cp4 see zeros for their peers' tokens, so their losses are not compared)."""
    base = {r["shape"]: r for r in rows if r["case"] == "unsharded" and r["status"] == "ok"}
    for row in rows:
        ref = base.get(row["shape"])
        compared = row["case"] == "cp1" and row["status"] == "ok" and ref
        if compared and abs(row["loss"] - ref["loss"]) > _LOSS_RTOL[dtype] * abs(ref["loss"]):
            row["status"] = f"ok, but loss {row['loss']:.6g} != unsharded {ref['loss']:.6g}"


_COLUMNS = (
    CASE,
    shape_column("layout, tokens"),
    Column("local tokens", "local_tokens", ",.0f"),
    *measurement_columns("x unsharded")[:2],
    ratio_column("ideal_mem_ratio", "ideal 1/cp"),
    *measurement_columns("x unsharded")[2:],
    Column("loss", "loss", ".4f"),
    STATUS,
)
_FULL_CPU = {"tokens": [8192, 16384], "layouts": ["padded", "docs4"], "repeat": 1, "warmup": 1, "threads": 1}
_FULL_CUDA = {"tokens": [32768, 131072], "layouts": ["padded", "docs4"]}
_QUICK = {"tokens": [512], "layouts": ["padded"], "repeat": 1, "warmup": 0}
"""The CPU grid stops at 16K tokens: the backward of ``transformers``' torch Gated DeltaNet kernel is quadratic
in the sequence (each 64-token chunk's slice of its inputs gets a zero-filled gradient of the whole tensor), so
one step at 32K takes 2.3 minutes unsharded on one core (4.5x the 16K step). It runs one thread per worker: that
kernel is thousands of small ops (a Python loop over the chunks), and on a CPU shared with other processes each
of them can wait for an intra-op thread that was descheduled (10-100x slower, and noisy); ``--threads`` sets
another count."""


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        help="sequence lengths (default: 8192 16384 on CPU, 32768 131072 on CUDA)",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=list(LAYOUTS),
        help="padded: one sequence; docs4: 4 equal documents packed in one row (default: both)",
    )
    parser.add_argument(
        "--threads", type=int, help="torch's intra-op threads per worker (default: 1 on CPU, torch's on CUDA)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 layers, 512 tokens, one run")
    args = parse_arguments(
        parser, argv, cpu=_FULL_CPU, cuda=_FULL_CUDA, quick=_QUICK, positive=("tokens", "threads")
    )
    if any(tokens % LAYOUTS[layout] for tokens in args.tokens for layout in args.layouts):
        parser.error(
            f"--tokens {args.tokens}: each must split into the documents of --layouts {args.layouts}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid, print the table and return its rows (also written to ``--json``, ``--markdown``)."""
    args = _parse_args(argv)
    cases = start(args, _CASES, _measure)
    if cases is None:
        return []
    model = "tiny" if args.quick else "qwen3.5-tiny"
    shapes = [Shape(model, tokens, layout) for layout in args.layouts for tokens in args.tokens]
    started = time.perf_counter()
    rows = run_grid(shapes, cases, lambda shape, case: _measure_case(shape, case, args))
    add_ratios(rows, "unsharded")
    _check_cp1_loss(rows, DTYPES[args.dtype])
    config = MODELS[model]
    publish(
        rows,
        _COLUMNS,
        args=args,
        title=(
            f"Hybrid model ({model}: {config['num_hidden_layers']} layers {config['layer_types']}, width "
            f"{config['hidden_size']}), forward + backward + fused loss of rank 0, {args.dtype} on "
            f"{args.device.type}; time: median of {args.repeat} after {args.warmup} warm-up"
        ),
        notes=(
            "peak extra: the step's peak minus before it, minus the parameters' gradients; cpN: rank 0 of a "
            "simulated CP group of N (peers' data are zeros: their losses are not the model's); ideal 1/cp: "
            "the share of unsharded's memory an even split would leave a rank."
        ),
        wall_s=time.perf_counter() - started,
        packages=_PACKAGES,
    )
    return rows


if __name__ == "__main__":
    main()
