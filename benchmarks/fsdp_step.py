"""Time and peak memory of a training step under ``MegatronCPFSDPStrategy``, bf16-mixed, one process.

A Lightning ``Trainer`` (one device, world size 1: gloo on the CPU, NCCL on CUDA) fits the package's
``GPTModule`` on random tokens with FSDP2 (``fully_shard`` units of the GPT blocks), activation
checkpointing of the blocks, ``precision="bf16-mixed"`` (fp32 master weights and AdamW state, bf16
compute) and the fused loss. A callback times every optimizer step (forward, backward, AdamW) and reads the
memory high-water mark during it; the first ``--warmup`` steps are dropped. This is the path the issue
lists as never run on a GPU: FSDP's bf16 all-gathers and reduce-scatters and the DTensor head of the loss.

=========  ===============================================================================================
``fsdp``   ``MegatronCPFSDPStrategy(cp=1, activation_checkpointing=["_Block"])``
``ddp``    the same model and step under ``MegatronCPStrategy(cp=1)`` (DDP), for comparison
=========  ===============================================================================================

Run from the repository root::

    python benchmarks/fsdp_step.py --quick                      # tiny GPT on the CPU
    python benchmarks/fsdp_step.py                              # on a GPU: ~1.1B GPT, 16K tokens
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from _harness import (
    Case,
    ModelShape,
    parse_arguments,
    run_case,
    run_grid,
    start,
)
from _probes import GIB, MIB, memory_probe, set_memory_budget, synchronize
from _report import CASE, STATUS, Column, publish, shape_column

_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}
_GPT_1B = {"vocab_size": 128256, "n_layer": 16, "n_head": 16, "n_embd": 2048}
"""About 1.07B parameters (tied embeddings)."""
_GPT_TINY = {"vocab_size": 512, "n_layer": 2, "n_head": 4, "n_embd": 64}
_PACKAGES = ("lightning", "megatron-core")
_RUNTIME_OVERHEAD_BYTES = 2 * GIB


MODELS = {"gpt-1b": _GPT_1B, "tiny": _GPT_TINY}
"""The configurations a row names (``ModelShape.model``)."""


def _strategy_builder(fsdp: bool) -> Callable[[None], Callable[[], Any]]:
    """The case's ``build``: what makes the strategy of the worker's Trainer."""

    def build(_: None) -> Callable[[], Any]:
        from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy

        strategy = MegatronCPFSDPStrategy if fsdp else MegatronCPStrategy
        return lambda: strategy(cp=1, activation_checkpointing=["_Block"])

    return build


def _estimate(shape: ModelShape) -> int:
    """Weights, gradients and AdamW state (16 B / parameter), the blocks' inputs, one block recomputed."""
    c = MODELS[shape.model]
    params = c["n_layer"] * 12 * c["n_embd"] ** 2 + c["vocab_size"] * c["n_embd"]
    return 16 * params + shape.tokens * c["n_embd"] * (2 * c["n_layer"] + 40)


_CASES: tuple[Case[None, ModelShape], ...] = (
    Case(
        "fsdp",
        "MegatronCPFSDPStrategy, activation checkpointing of the blocks",
        _strategy_builder(True),
        _estimate,
    ),
    Case(
        "ddp",
        "MegatronCPStrategy() (DDP), activation checkpointing of the blocks",
        _strategy_builder(False),
        _estimate,
    ),
)
_CASES_BY_NAME = {case.name: case for case in _CASES}


# --------------------------------------------------------------------------------------------------
# The worker: one Trainer.fit of warmup + repeat steps


def _step_probe(device: torch.device) -> Any:
    from lightning.pytorch import Callback

    class StepProbe(Callback):
        """Wall time and memory high-water mark of every training step (batch start to batch end)."""

        def __init__(self) -> None:
            self.probe = memory_probe(device)
            self.times_ms: list[float] = []
            self.peaks: list[int] = []
            self.extra: list[int] = []

        def on_train_batch_start(self, *args: Any) -> None:
            synchronize(device)
            self.base = self.probe.start()
            self.begin = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            synchronize(device)
            self.times_ms.append((time.perf_counter() - self.begin) * 1e3)
            self.peaks.append(self.probe.peak())
            self.extra.append(self.peaks[-1] - self.base)

    return StepProbe()


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader

    from lightning_cp.models import GPTConfig, GPTModule

    device = torch.device(spec["device"])
    shape = ModelShape(**spec["shape"])
    seed_everything(0)
    steps = spec["warmup"] + spec["repeat"]
    g = torch.Generator().manual_seed(0)
    config = MODELS[shape.model]
    samples = [
        {"input_ids": torch.randint(config["vocab_size"], (shape.tokens,), generator=g)} for _ in range(steps)
    ]
    probe = _step_probe(device)
    set_memory_budget(device, int(spec["max_mem_gib"] * GIB))
    trainer = Trainer(
        accelerator=device.type,
        devices=1,
        strategy=_CASES_BY_NAME[spec["case"]].build(None)(),
        precision=_PRECISION[spec["dtype"]],
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[probe],
    )
    trainer.fit(GPTModule(GPTConfig(**config)), DataLoader(samples, batch_size=1))
    timed = slice(spec["warmup"], None)
    return {
        "status": "ok",
        "time_ms": statistics.median(probe.times_ms[timed]),
        "times_ms": probe.times_ms,
        "peak_bytes": max(probe.peaks[timed]),
        "peak_extra_bytes": max(probe.extra[timed]),
        "loss": float(trainer.callback_metrics.get("train/loss_step", float("nan"))),
    }


# --------------------------------------------------------------------------------------------------
# The parent


def _measure_case(shape: ModelShape, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    row = {"case": case.name, "shape": shape.label(), **asdict(shape), "dtype": args.dtype}
    spec = {"shape": asdict(shape), "dtype": args.dtype}
    return {
        **row,
        **run_case(Path(__file__), case, args, spec, case.estimate(shape) + _RUNTIME_OVERHEAD_BYTES),
    }


_COLUMNS = (
    CASE,
    shape_column("model, tokens"),
    Column("step ms", "time_ms", ",.1f"),
    Column("peak MiB", "peak_bytes", ",.0f", scale=MIB),
    Column("step extra MiB", "peak_extra_bytes", ",.0f", scale=MIB),
    STATUS,
)
_FULL_CPU = {"tokens": [1024], "dtype": "bf16"}  # bf16-mixed on every device unless --dtype says otherwise
_FULL_CUDA = {"tokens": [16384], "dtype": "bf16"}
_QUICK = {"tokens": [128], "repeat": 1, "warmup": 1}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", help="sequence lengths (default: 16384 on CUDA)")
    parser.add_argument("--quick", action="store_true", help="smoke test: a tiny GPT, 128 tokens, 2 steps")
    return parse_arguments(parser, argv, cpu=_FULL_CPU, cuda=_FULL_CUDA, quick=_QUICK, positive=("tokens",))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the grid, print the table and return its rows (also written to ``--json``, ``--markdown``)."""
    args = _parse_args(argv)
    cases = start(args, _CASES, _measure)
    if cases is None:
        return []
    started = time.perf_counter()
    shapes = [ModelShape("tiny" if args.quick else "gpt-1b", tokens) for tokens in args.tokens]
    rows = run_grid(shapes, cases, lambda shape, case: _measure_case(shape, case, args))
    publish(
        rows,
        _COLUMNS,
        args=args,
        title=(
            f"one training step (forward, backward, AdamW), precision {_PRECISION[args.dtype]} on "
            f"{args.device.type}, world size 1; median of {args.repeat} steps after {args.warmup}"
        ),
        notes="peak: the memory high-water mark during a step (CUDA allocator; CPU: resident set).",
        wall_s=time.perf_counter() - started,
        packages=_PACKAGES,
    )
    return rows


if __name__ == "__main__":
    main()
