"""Print the per-rank memory of the layouts that train a model at a sequence length, and which fit.

Run::

    lightning-cp plan examples/configs/models/llama3_8b.json --seq-len 1M --gpus 8 --gpu-memory 80GB
    lightning-cp plan examples/configs/models/llama3_8b.json --gpus 8 --max-seq
    lightning-cp plan examples/configs/models/llama3_8b.json --gpus 1 --max-seq --host-memory 240GB
    lightning-cp plan examples/configs/models/llama3_70b.json --gpus 1 --max-seq --qlora --host-memory 256GB

``MODEL`` is a ``transformers`` config (a JSON file with its ``model_type``, or a local ``save_pretrained``
directory; no weights are read) or a JSON file of :class:`~lightning_cp.models.GPTConfig` fields. Every
layout (cp, DDP, FSDP or FSDP with the model state on the host, checkpointing, offload, tiled MLPs, experts
and norms) gets its parameters, gradients, optimizer state, saved activations, largest transient and reserve
per rank, and what it keeps on the host (:mod:`lightning_cp.plan`); those that fit are listed cheapest
first, and the arguments that give the first are printed: the Trainer's precision, the strategy and the
module class (``GPTModule`` or ``HFCausalLM``) with their arguments. ``--max-seq`` finds the longest
sequence that fits. ``--lora RANK`` plans LoRA adapters on every linear layer of a frozen bf16 base,
``--qlora`` the base's linear weights in NF4 besides (rank 16 unless ``--lora`` says otherwise)
(:mod:`lightning_cp.plan.lora`); the printed ``lora`` is ``HFCausalLM``'s. Bad input is one line on stderr
and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import yaml

from lightning_cp.plan import Candidate, Layout, ModelShape, layouts, max_seq_len, plan
from lightning_cp.plan.activations import PRECISIONS
from lightning_cp.plan.flops import StepFlops, step_flops
from lightning_cp.plan.lora import LoRA

_UNITS = {"": 1, "K": 2**10, "M": 2**20}
_MEMORY_UNITS = {"GB": 10**9, "GIB": 2**30, "": 10**9}
GiB = 2**30
_COLUMNS = (
    "GiB per rank; host: kept in host memory, h2d+d2h: copied between host and GPU per step; cp, dp: GiB sent "
    "per step for context parallelism and by DDP / FSDP; PFLOP: one rank's per step, the model's (6NT + causal "
    "attention) + recomputation's"
)
"""What the table's columns hold, after the line that says the sequence, the GPUs and the precision."""


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-cp plan MODEL --gpus N [--seq-len S | --max-seq] ...``; returns the exit status (2: bad input)."""
    args = _parser().parse_args(argv)
    try:
        shape = read_model(args.model)
        gpu_bytes = _memory(args.gpu_memory, "--gpu-memory")
        args.host_bytes = None if args.host_memory is None else _memory(args.host_memory, "--host-memory")
        if args.gpus < 1:
            raise ValueError(f"--gpus {args.gpus}: give a positive number of GPUs.")
        args.adapters = _lora(args)
        if args.adapters is not None:
            args.adapters.adapters(shape)  # a shape without its linear weights counted is refused here
        if args.max_seq:
            _print_max_seq(shape, args, gpu_bytes)
        else:
            if args.seq_len is None:
                raise ValueError("give --seq-len (e.g. 128K, 1M) or --max-seq.")
            _print_plan(shape, _tokens(args.seq_len), args, gpu_bytes)
    except ValueError as error:
        print(f"lightning-cp plan: error: {error}", file=sys.stderr)
        return 2
    return 0


def read_model(model: str) -> ModelShape:
    """The :class:`ModelShape` of ``MODEL``: a directory or JSON file of a ``transformers`` config, or a JSON
    file of ``GPTConfig`` fields; a ``ValueError`` with one line otherwise."""
    path = Path(model)
    if path.is_dir():
        return ModelShape.from_hf_config(path)
    if not path.is_file():
        raise ValueError(f"model {model!r}: no such file or directory; give a config JSON file or directory.")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"model {model!r}: not JSON ({error}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"model {model!r}: not a JSON object of config fields.")  # noqa: TRY004
    if "model_type" in config:
        return ModelShape.from_hf_config(config)
    from lightning_cp.models.gpt import GPTConfig

    try:
        return ModelShape.from_gpt_config(GPTConfig(**config))
    except TypeError as error:
        raise ValueError(
            f"model {model!r}: neither a transformers config (no model_type) nor GPTConfig fields ({error})."
        ) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-cp plan", description=__doc__.split("\n")[0])
    parser.add_argument(
        "model", help="a transformers config (JSON file or directory) or a GPTConfig JSON file"
    )
    parser.add_argument("--seq-len", help="tokens per sequence: 131072, 128K, 1M")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs in all, dp * cp (default: 8)")
    parser.add_argument(
        "--gpu-memory", default="80GB", help="memory of one GPU: 80GB, 141GB, 79.6GiB (default: 80GB)"
    )
    parser.add_argument(
        "--host-memory",
        help="host memory each GPU may use (the node's memory over its GPUs), e.g. 240GB: rules out the "
        "layouts that keep more on the host (default: not checked)",
    )
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="bf16-mixed", help="Trainer(precision=...)"
    )
    parser.add_argument(
        "--loss-chunk", type=int, help="tokens per chunk of the fused loss (default: automatic)"
    )
    parser.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="LoRA adapters of this rank on every linear layer of the decoder, the base frozen in bf16",
    )
    parser.add_argument(
        "--qlora",
        action="store_true",
        help="QLoRA: LoRA (rank 16 unless --lora) with the base's linear weights in NF4 (torchao's)",
    )
    parser.add_argument("--max-seq", action="store_true", help="find the longest sequence that fits instead")
    parser.add_argument("--all", action="store_true", help="list the layouts that do not fit too")
    return parser


def _lora(args: argparse.Namespace) -> LoRA | None:
    """``--lora RANK`` and ``--qlora`` as a :class:`~lightning_cp.plan.lora.LoRA` (``None``: neither)."""
    if args.lora is None and not args.qlora:
        return None
    if args.lora is not None and args.lora < 1:
        raise ValueError(f"--lora {args.lora}: give a positive LoRA rank, e.g. --lora 16.")
    return LoRA(16 if args.lora is None else args.lora, "nf4" if args.qlora else None)


def _tokens(text: str) -> int:
    match = re.fullmatch(r"(\d+)([KkMm]?)", text.strip())
    if match is None or int(match[1]) == 0:
        raise ValueError(f"--seq-len {text!r}: give a positive token count, e.g. 131072, 128K or 1M.")
    return int(match[1]) * _UNITS[match[2].upper()]


def _memory(text: str, option: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GB|GiB|)", text.strip(), flags=re.IGNORECASE)
    if match is None or float(match[1]) <= 0:
        raise ValueError(f"{option} {text!r}: give an amount of memory, e.g. 80GB or 79.6GiB.")
    return int(float(match[1]) * _MEMORY_UNITS[match[2].upper()])


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f}"


def _describe(shape: ModelShape, lora: LoRA | None = None) -> str:
    kind = "package GPT" if shape.architecture == "gpt" else "transformers"
    heads = f"{shape.heads}/{shape.kv_heads} heads x {shape.head_dim}"
    if shape.v_head_dim != shape.head_dim:
        heads += f" (values {shape.v_head_dim})"
    line = (
        f"{kind}: {shape.params / 1e9:.2f}B parameters, {shape.layers} layers, hidden {shape.hidden}, "
        f"{heads}, ffn {shape.ffn}, vocab {shape.vocab}"
    )
    sparse = shape.sparse
    if sparse is not None:
        line += (
            f"\nsparse attention on {sparse.layers} layers: top-{sparse.topk} keys per query, indexer "
            f"{sparse.heads} heads x {sparse.head_dim} on {sparse.indexer_layers} layers (select: their saved "
            "selections; transients sparse_attention and indexer: one layer's backward and selection)"
        )
    if lora is not None:
        assert shape.linears is not None
        base = "linear weights in NF4, the rest in bf16" if lora.quantize else "in bf16"
        line += (
            f"\n{'QLoRA' if lora.quantize else 'LoRA'} rank {lora.rank} on {shape.linears.count} linear layers: "
            f"{lora.adapters(shape) / 1e6:.1f}M adapter parameters trained (master weights, gradients and "
            f"AdamW state in the precision's master dtype); the base frozen, {base}: "
            f"{_gib(lora.base_bytes(shape, 2))} GiB, no gradients or optimizer state"
        )
    return line


def _header(sparse: bool) -> str:
    select = f"{'select':>7}" if sparse else ""
    width = 22 if sparse else 20  # "sparse_attention" is the longest transient's name
    return (
        f"{'layout':<62}{'params':>7}{'grads':>7}{'optim':>7}{'fsdp':>6}{'saved':>7}{select}{'transient':>{width}}"
        f"{'reserve':>8}{'peak':>7}{'host':>7}{'h2d+d2h':>8}{'cp':>8}{'dp':>7}{'PFLOP':>13}"
    )


def _row(candidate: Candidate, sparse: bool, flops: StepFlops) -> str:
    """``candidate``'s line: its GiB per rank, the GiB it sends per step for CP and for the wrapper, and one
    rank's PFLOP per step (the model's + the recomputation's, ``flops``)."""
    e = candidate.estimate
    pflop = f"{flops.model / 1e15:.1f}+{flops.recomputed / 1e15:.1f}"
    cells = [
        (_gib(e.parameters), 7),
        (_gib(e.gradients), 7),
        (_gib(e.optimizer), 7),
        (_gib(e.fsdp_gathered), 6),
    ]
    cells += [(_gib(e.activations), 7)] + ([(_gib(e.selections), 7)] if sparse else [])
    cells += [(f"{_gib(e.transient)} {e.largest_transient}", 22 if sparse else 20), (_gib(e.reserve), 8)]
    cells += [(_gib(e.peak), 7), (_gib(e.host), 7), (_gib(e.host_transfer), 8), (_gib(e.cp_communication), 8)]
    cells += [(_gib(e.communication - e.cp_communication), 7), (pflop, 13)]
    # Right-aligned under the header, a space before each even when a figure is as wide as its column.
    return f"{candidate.layout.name():<62}" + "".join(" " + text.rjust(width - 1) for text, width in cells)


def _arguments(shape: ModelShape, candidate: Candidate) -> str:
    """The config that gives ``candidate`` (:meth:`~lightning_cp.plan.Candidate.config`: the precision, the
    strategy and the module class with their arguments), as YAML for ``lightning-cp fit --config``."""
    return yaml.safe_dump(candidate.config(shape), sort_keys=False).rstrip()


def _print_plan(shape: ModelShape, seq_len: int, args: argparse.Namespace, gpu_bytes: int) -> None:
    options = {"precision": args.precision, "loss_chunk": args.loss_chunk, "lora": args.adapters}
    candidates = plan(shape, seq_len, args.gpus, host_bytes=args.host_bytes, **options)
    fitting = [c for c in candidates if c.fits(gpu_bytes, args.host_bytes)]
    print(_describe(shape, args.adapters))
    print(
        f"{seq_len:,} tokens per sequence on {args.gpus} GPUs of {_gib(gpu_bytes)} GiB, {args.precision}; "
        + _COLUMNS
    )
    print()
    sparse = shape.sparse is not None
    print(_header(sparse))
    for candidate in candidates if args.all else fitting:
        fits = candidate.fits(gpu_bytes, args.host_bytes)
        flops = step_flops(shape, seq_len, candidate.layout)
        print(_row(candidate, sparse, flops) + ("" if fits else "  does not fit"))
    if not fitting:
        best = min(candidates, key=lambda c: c.estimate.peak)
        print(
            f"no layout fits {_gib(gpu_bytes)} GiB; the smallest peak is {_gib(best.estimate.peak)} GiB "
            f"({best.layout.name()}): more GPUs, a shorter sequence, or try --max-seq."
        )
    else:
        print(
            f"\n{len(fitting)} of {len(candidates)} layouts fit, cheapest first (the model state on the host last)."
        )
        print(f"\nThe first, as arguments:\n{_arguments(shape, fitting[0])}")


def _print_max_seq(shape: ModelShape, args: argparse.Namespace, gpu_bytes: int) -> None:
    options = {"precision": args.precision, "loss_chunk": args.loss_chunk, "lora": args.adapters}
    lengths: dict[Layout, int] = {
        layout: max_seq_len(shape, layout, gpu_bytes, host_bytes=args.host_bytes, **options)
        for layout in layouts(args.gpus, shape)
    }
    longest = max(lengths.values())
    print(_describe(shape, args.adapters))
    if longest == 0:
        print(f"not even 1,024 tokens fit on {args.gpus} GPUs of {_gib(gpu_bytes)} GiB ({args.precision}).")
        return
    best = plan(shape, longest, args.gpus, host_bytes=args.host_bytes, **options)
    best = [c for c in best if lengths[replace(c.layout, offload_layers=None)] == longest]
    print(
        f"longest sequence on {args.gpus} GPUs of {_gib(gpu_bytes)} GiB ({args.precision}): {longest:,} tokens"
    )
    print(_COLUMNS)
    print()
    sparse = shape.sparse is not None
    print(_header(sparse))
    for candidate in best:
        print(_row(candidate, sparse, step_flops(shape, longest, candidate.layout)))
    print(f"\nThe first, as arguments:\n{_arguments(shape, best[0])}")
