"""A Hugging Face Llama-1B-shaped forward and backward at long context: lightning-cp vs HF + Liger.

One training forward + backward of ``LlamaForCausalLM`` (Llama-3.2-1B's shape by default, random
weights, ``--dtype`` parameters, gradient checkpointing of every decoder layer) on one sequence of
``--tokens``, without CP (cp = 1: what one GPU runs), built by ``lightning_cp.models.HFCausalLM``:

=============  ========================================================================================
``ours``       ``attn_implementation="lightning_cp"`` on a batch sharded for cp = 1 and recorded as the
               strategy does (the package's attention path), the decoder's hidden states into
               ``lightning_cp.ops.linear_cross_entropy`` with the tied LM head (no logits)
``hf_liger``   the same model on ``"sdpa"`` attention with Liger-Kernel's Llama patches
               (``apply_liger_kernel_to_llama``: RoPE, RMSNorm, SwiGLU and its fused linear
               cross-entropy), ``model(input_ids, labels=input_ids).loss``; needs ``liger-kernel``
=============  ========================================================================================

Both compute the mean next-token cross-entropy of the sequence; the table flags a case whose loss differs
from ``ours``. Columns: wall time of forward + backward (median of ``--repeat``), the peak memory the
step adds, and the absolute peak (weights and gradients included). Each case runs in a fresh worker.

Run from the repository root::

    python benchmarks/hf_llama.py --quick                      # tiny Llama on the CPU
    python benchmarks/hf_llama.py --tokens 32768 131072        # on a GPU: bf16, Llama-1B shape
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _harness import (
    DTYPES,
    Case,
    ModelShape,
    needs_module,
    parse_arguments,
    run_case,
    run_grid,
    start,
)
from _probes import GIB, MIB, measure, memory_probe, set_memory_budget
from _report import CASE, STATUS, Column, add_ratios, publish, ratio_column, shape_column
from torch import Tensor

LLAMA_1B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
}
"""Llama-3.2-1B's shape (1.24B parameters); ``--quick`` takes ``tiny``: 2 layers of width 64."""
_TINY = {
    **LLAMA_1B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
_LOSS_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
_PACKAGES = ("transformers", "liger-kernel", "triton")
_RUNTIME_OVERHEAD_BYTES = 2 * GIB


MODELS = {"llama-1b": LLAMA_1B, "tiny": _TINY}
"""The configurations a row names (``ModelShape.model``)."""


@dataclass
class _Problem:
    model: torch.nn.Module
    """The ``transformers`` ``LlamaForCausalLM`` (training mode, gradient checkpointing on)."""
    input_ids: Tensor
    """``[1, T]`` random token ids."""


def _make_problem(shape: ModelShape, dtype: torch.dtype, device: torch.device) -> _Problem:
    from lightning_cp.models import HFCausalLM

    torch.manual_seed(0)  # the same weights in every case's worker, so that their losses compare
    config = MODELS[shape.model]
    module = HFCausalLM(config, dtype=str(dtype).removeprefix("torch."), gradient_checkpointing=True)
    with device:  # built and initialized on the device: seconds for 1B parameters, not a minute on the CPU
        module.configure_model()
    model = module.model.train()
    ids = torch.randint(config["vocab_size"], (1, shape.tokens), generator=torch.Generator().manual_seed(0))
    return _Problem(model, ids.to(device))


def _build_ours(p: _Problem) -> Callable[[], Tensor]:
    from lightning_cp.hf import decoder
    from lightning_cp.ops import linear_cross_entropy
    from lightning_cp.parallel import shard_batch

    batch = shard_batch({"input_ids": p.input_ids}, 1, 0)  # labels: the next token; positions; cp_shard
    weight = p.model.get_output_embeddings().weight
    body = decoder(p.model)

    def step() -> Tensor:
        out = body(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            cp_shard=batch["cp_shard"],
            use_cache=False,
        )
        return linear_cross_entropy(out.last_hidden_state[0], weight, batch["labels"][0])

    return step


def _build_hf_liger(p: _Problem) -> Callable[[], Tensor]:
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    p.model.set_attn_implementation("sdpa")
    apply_liger_kernel_to_llama(model=p.model)  # RoPE, RMSNorm, SwiGLU, fused linear cross-entropy
    positions = torch.arange(p.input_ids.shape[1], device=p.input_ids.device)[None]
    return lambda: (
        p.model(input_ids=p.input_ids, position_ids=positions, labels=p.input_ids, use_cache=False).loss
    )


def _estimate(sizes: tuple[ModelShape, int]) -> int:
    """Weights and gradients, the checkpointed layer inputs, one layer's recomputed activations."""
    shape, itemsize = sizes
    c = MODELS[shape.model]
    layer = 4 * c["hidden_size"] ** 2 + 3 * c["hidden_size"] * c["intermediate_size"]
    params = c["num_hidden_layers"] * layer + c["vocab_size"] * c["hidden_size"]
    width = c["num_hidden_layers"] * c["hidden_size"] + 12 * c["intermediate_size"] + 8 * c["hidden_size"]
    return 2 * params * itemsize + shape.tokens * width * itemsize


_CASES: tuple[Case[_Problem, tuple[ModelShape, int]], ...] = (
    Case(
        "ours",
        "lightning_cp attention (a cp=1 shard) + lightning_cp.ops.linear_cross_entropy",
        _build_ours,
        _estimate,
        needs=(needs_module("transformers", "transformers"),),
    ),
    Case(
        "hf_liger",
        "HF sdpa attention + Liger-Kernel Llama patches (fused linear cross-entropy), labels= loss",
        _build_hf_liger,
        _estimate,
        needs=(needs_module("transformers", "transformers"), needs_module("liger_kernel", "liger-kernel")),
    ),
)
_CASES_BY_NAME = {case.name: case for case in _CASES}


# --------------------------------------------------------------------------------------------------
# The worker


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    case = _CASES_BY_NAME[spec["case"]]
    device = torch.device(spec["device"])
    p = _make_problem(ModelShape(**spec["shape"]), DTYPES[spec["dtype"]], device)
    step = case.build(p)
    params = [t for t in p.model.parameters() if t.requires_grad]

    def reset() -> None:
        for t in params:
            t.grad = None

    def forward_backward() -> Tensor:
        loss = step()
        loss.backward()
        return loss.detach().float()

    set_memory_budget(device, int(spec["max_mem_gib"] * GIB))
    probe = memory_probe(device)
    measurement, loss = measure(
        forward_backward,
        device,
        warmup=spec["warmup"],
        repeat=spec["repeat"],
        reset=reset,
        retained=lambda: sum(t.grad.nbytes for t in params if t.grad is not None),
    )
    return {"status": "ok", **measurement.summary(), "peak_bytes": probe.peak(), "loss": loss.item()}


# --------------------------------------------------------------------------------------------------
# The parent


def _measure_case(shape: ModelShape, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    itemsize = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    estimate = case.estimate((shape, itemsize)) + _RUNTIME_OVERHEAD_BYTES
    row = {"case": case.name, "shape": shape.label(), **asdict(shape), "dtype": args.dtype}
    spec = {"shape": asdict(shape), "dtype": args.dtype}
    return {**row, **run_case(Path(__file__), case, args, spec, estimate)}


def _check_against_ours(rows: list[dict[str, Any]], dtype: torch.dtype) -> None:
    """Time and memory over ``ours`` on the same shape; flag a loss that differs from ours'."""
    add_ratios(rows, "ours", {"time_x_ours": "time_ms", "mem_x_ours": "peak_extra_bytes"})
    ours = {r["shape"]: r for r in rows if r["case"] == "ours" and r["status"] == "ok"}
    for row in rows:
        base = ours.get(row["shape"])
        if (
            row["status"] == "ok"
            and base
            and abs(row["loss"] - base["loss"]) > _LOSS_RTOL[dtype] * base["loss"]
        ):
            row["status"] = f"ok, but loss {row['loss']:.6g} != ours {base['loss']:.6g}"


_COLUMNS = (
    CASE,
    shape_column("model, tokens"),
    Column("time ms", "time_ms", ",.1f"),
    ratio_column("time_x_ours", "x ours"),
    Column("step extra MiB", "peak_extra_bytes", ",.0f", scale=MIB),
    ratio_column("mem_x_ours", "x ours"),
    Column("peak MiB", "peak_bytes", ",.0f", scale=MIB),
    Column("loss", "loss", ".4f"),
    STATUS,
)
_FULL_CPU = {"tokens": [1024]}
_FULL_CUDA = {"tokens": [32768, 131072]}
_QUICK = {"tokens": [256], "repeat": 1, "warmup": 1}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", type=int, nargs="+", help="sequence lengths (default: 32768 131072 on CUDA)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke test: a tiny Llama, 256 tokens, one run")
    return parse_arguments(parser, argv, cpu=_FULL_CPU, cuda=_FULL_CUDA, quick=_QUICK, positive=("tokens",))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid, print the table and return its rows (also written to ``--json``, ``--markdown``)."""
    args = _parse_args(argv)
    cases = start(args, _CASES, _measure)
    if cases is None:
        return []
    shapes = [ModelShape("tiny" if args.quick else "llama-1b", tokens) for tokens in args.tokens]
    started = time.perf_counter()
    rows = run_grid(shapes, cases, lambda shape, case: _measure_case(shape, case, args))
    _check_against_ours(rows, DTYPES[args.dtype])
    publish(
        rows,
        _COLUMNS,
        args=args,
        title=(
            f"Llama forward + backward, {args.dtype} on {args.device.type}, gradient checkpointing, cp = 1; "
            f"time: median of {args.repeat} after {args.warmup} warm-up"
        ),
        notes="step extra: peak during the step minus before it, minus the gradients; peak: absolute.",
        wall_s=time.perf_counter() - started,
        packages=_PACKAGES,
    )
    return rows


if __name__ == "__main__":
    main()
