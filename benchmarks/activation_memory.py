"""What a decoder keeps between forward and backward: plain, checkpointed, offloaded, with tiled MLPs, norms and projections.

For the package GPT and a tiny ``transformers`` Llama on one long sequence (CPU, fp32, one process), each
row runs one forward + backward in a fresh worker process:

- ``plain``: autograd keeps every layer's activations;
- ``checkpointing``: ``torch.distributed._composable.checkpoint`` on every decoder layer (what
  ``activation_checkpointing`` applies): each keeps its inputs;
- ``checkpointing+offload``: and :func:`lightning_cp.memory.offload_checkpointed` (``offload_activations``):
  those inputs in host memory;
- ``+tiled``: and :func:`lightning_cp.memory.tile_model` (MLPs, norms, the projections reading the norms).

Columns: ``resident MiB/layer``, the bytes of the tensors created inside the decoder layers that are still
alive when the forward ends (a dispatch mode sees every tensor created, weak references say which live),
per layer; on the CPU the host is the device, so what the offload moved is counted apart (``to host MiB``)
and not as resident. ``peak extra MiB``: the resident set's high-water mark over the step minus before it
(``_probes``). ``loss`` and ``|grad|`` (the gradients' global norm) must equal ``plain``'s (``= plain``).

Run from the repository root::

    python benchmarks/activation_memory.py                 # T 8192, d 256, 4 layers
    python benchmarks/activation_memory.py --quick         # tiny shapes (CI)
    python benchmarks/activation_memory.py --markdown      # the table of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import run_worker, worker_main
from _probes import MIB, measure
from _report import Column, format_table

CASES = ("plain", "checkpointing", "checkpointing+offload", "+tiled")
MODELS = ("gpt", "llama")
COLUMNS = [
    Column("model", "model", align="<"),
    Column("case", "case", align="<"),
    Column("resident MiB/layer", "resident_per_layer", ".1f", MIB),
    Column("to host MiB", "offloaded", ".1f", MIB),
    Column("peak extra MiB", "peak_extra_bytes", ".0f", MIB),
    Column("loss", "loss", ".6f"),
    Column("|grad|", "grad_norm", ".6f"),
    Column("= plain", "same", align="<"),
]


class _CreatedInLayers(TorchDispatchMode):
    """Weak references to every tensor an op creates while a decoder layer's forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.created: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.depth:
            self.created.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def resident_bytes(self) -> int:
        storages = {}
        for ref in self.created:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def _build(
    model: str, tokens: int, dim: int, layers: int, vocab: int
) -> tuple[torch.nn.Module, list[Any], Any]:
    """The model (seed 0), its decoder layers, and a step ``(model, ids) -> loss``."""
    torch.manual_seed(0)
    if model == "gpt":
        from lightning_cp.models.gpt import GPT, GPTConfig

        gpt = GPT(GPTConfig(vocab_size=vocab, n_layer=layers, n_head=dim // 64, n_embd=dim))

        def gpt_loss(ids: torch.Tensor) -> torch.Tensor:
            hidden = gpt(ids, torch.arange(ids.shape[1]).expand_as(ids))
            logits = hidden @ gpt.lm_head_weight.T
            return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])

        return gpt, list(gpt.blocks), gpt_loss
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=4 * dim,
        num_hidden_layers=layers,
        num_attention_heads=dim // 64,
        num_key_value_heads=max(1, dim // 128),
        max_position_embeddings=tokens,
        attn_implementation="sdpa",
    )
    llama = LlamaForCausalLM(config)
    # use_cache=False as HFCausalLM calls it: else a DynamicCache keeps every layer's K/V to the end of the step
    return llama, list(llama.model.layers), lambda ids: llama(input_ids=ids, labels=ids, use_cache=False).loss


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One forward + backward of ``spec``'s model and case, in this (fresh) process."""
    from torch.distributed._composable import checkpoint

    from lightning_cp.memory import offload_checkpointed, tile_model

    torch.set_num_threads(spec["threads"])
    model, layers, loss_of = _build(spec["model"], spec["tokens"], spec["dim"], spec["layers"], spec["vocab"])
    case, offload = spec["case"], None
    if case != "plain":
        for layer in layers:
            checkpoint(layer)
    if case in ("checkpointing+offload", "+tiled"):
        offload = offload_checkpointed(model)
    if case == "+tiled":
        tile_model(model)
    tracker = _CreatedInLayers()
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: setattr(tracker, "depth", tracker.depth + 1), prepend=True)
        layer.register_forward_hook(lambda *_: setattr(tracker, "depth", tracker.depth - 1), always_call=True)
    ids = torch.randint(0, spec["vocab"], (1, spec["tokens"]), generator=torch.Generator().manual_seed(1))
    resident: list[int] = []
    moved: list[int] = []

    def step() -> float:
        model.zero_grad(set_to_none=True)
        tracker.created.clear()
        with tracker:
            loss = loss_of(ids)
        moved.append(offload.stats.offloaded_bytes if offload is not None else 0)
        resident.append(tracker.resident_bytes() - moved[-1])
        if offload is not None:
            offload.reset_stats()
        loss.backward()
        return loss.item()

    measurement, loss = measure(step, torch.device("cpu"), warmup=0, repeat=1)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {
        **measurement.summary(),
        "resident_per_layer": resident[-1] / len(layers),
        "offloaded": moved[-1],
        "loss": loss,
        "grad_norm": torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item(),
    }


def _run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One row in a fresh CPU worker (:func:`_harness.run_worker`): the spec, its measurements and its status."""
    return {**spec, **run_worker(Path(__file__), spec, torch.device("cpu"))}


def _measured(spec: dict[str, Any]) -> dict[str, Any]:
    return {**_measure(spec), "status": "ok"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="sequence length (one sequence)")
    parser.add_argument("--dim", type=int, default=256, help="model width (heads of 64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quick", action="store_true", help="tiny shapes: T 512, d 128, 2 layers")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, _measured)
        return
    if args.quick:
        args.tokens, args.dim, args.layers = 512, 128, 2
    rows = []
    for model in args.models:
        plain = None
        for case in CASES:
            spec = {
                "model": model,
                "case": case,
                "tokens": args.tokens,
                "dim": args.dim,
                "layers": args.layers,
                "vocab": args.vocab,
                "threads": args.threads,
            }
            row = _run_worker(spec)
            plain = plain or row
            if row["status"] == "ok" and plain["status"] == "ok":
                same = abs(row["loss"] - plain["loss"]) <= 1e-6 * abs(plain["loss"]) and abs(
                    row["grad_norm"] - plain["grad_norm"]
                ) <= 1e-5 * abs(plain["grad_norm"])
                row["same"] = "yes" if same else "NO"
            rows.append(row)
    print(f"T={args.tokens}, d={args.dim}, {args.layers} layers, vocab {args.vocab}, fp32, CPU")
    print(format_table(rows, COLUMNS, markdown=args.markdown))
    if args.json:
        args.json.write_text(json.dumps({"results": rows}, indent=1))


if __name__ == "__main__":
    main()
