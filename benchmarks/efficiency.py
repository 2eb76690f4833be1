"""What one training step of one CP rank executes, counted on the CPU at real width without computing.

For a model of ``examples/configs/models/`` and the layout the plan chooses (``lightning_cp.plan``: the first
layout that fits the GPUs, else the one of smallest peak), one decoder layer of each kind and the LM head +
fused loss run forward and backward on fake tensors (``FakeTensorMode``: shapes and dtypes, no data, no
memory) of one rank's real shapes, its CP peers simulated (:class:`~lightning_cp.parallel.simulated.
SimulatedCPGroup`). A dispatch mode (:class:`Counter`) sees every operator the rank dispatches on device
tensors and counts:

- the operators per layer (metadata queries aside; each collective one operator, the simulation's own
  stand-ins not counted), at two token counts per rank, beside the tiles of the tiled modules;
- the FLOPs of every matmul by the dtype of its inputs (``torch.utils.flop_counter``'s formulas;
  ``_grouped_mm`` and FlashAttention's varlen calls counted here: the latter by the causal pairs each call
  sees, read from its real ``cu_seqlens``), under ``bf16-mixed`` as DDP runs it (fp32 parameters under
  ``torch.autocast``) or as FSDP2 does (``MixedPrecisionPolicy(param_dtype=bf16)``: bf16 parameters);
- the bytes this rank sends in every collective of the exchange (ring volumes: ``(cp - 1) / cp`` of the
  gathered or reduced tensor, as the plan counts them).

What runs is the GPU's path where the CPU's differs: CP attention takes its FlashAttention-2 varlen calls
(``_varlen.use_flash``), whose outputs are made here from their inputs' shapes; the fused loss's fp32
weight gradient is one bf16 GEMM with an fp32 output (``products.add_product``, CUDA's
``torch.mm(..., out_dtype=torch.float32)``); the top-k attention runs its Triton kernels' custom ops; a Gated
DeltaNet's chunked delta rule runs flash-linear-attention's kernels, which ``transformers`` resolves where
``fla`` is installed (``_fla_stand_in``: their launches and FLOPs, where the torch path loops over every chunk of
64 tokens). A depthwise convolution's backward is counted as twice its forward (``torch.utils.flop_counter``
ignores its groups). Host-side work (the shard's index arithmetic on the CPU) runs
for real and is not counted. The model's FLOPs are ``6 N T`` (``N``: one layer's parameters a token uses,
the routed experts' ``top_k / experts`` share) plus causal attention, ``6 (d_qk + d_v) h P`` with ``P`` the
query-key pairs the rank's queries see (``T (T + 1) / 2 / cp`` per sequence), not a hybrid mixer's recurrence
(``lightning_cp.plan.flops``); recomputation (checkpointing:
the layer's forward again; ``+tiled``: the tiled modules' forward once more) is stated apart. FSDP's and DDP's
own collectives and the host copies are the plan's terms recomputed from the parameter and activation
sizes (``lightning_cp.plan.terms``), beside the plan's columns.

A DSA model's layers (GLM-5's) loop over blocks whose number grows with the tokens (the indexer's query blocks
with their square: more queries, fewer in a block as the sequence grows): they are counted at a few token
counts per rank small enough to dispatch and fitted along the blocks the kernels' own functions give
(``_dsa_fit``), the fit checked against one more count; its model FLOPs count the top-k keys each query attends
and the indexer's causal scores (``lightning_cp.plan.flops``; the recomputation selects again).

Run from the repository root::

    python benchmarks/efficiency.py --markdown                 # every model, 1 and 8 GPUs at 1M tokens
    python benchmarks/efficiency.py --models llama3_8b --gpus 8
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _counting import Counts, count_layer, count_loss
from _dsa_fit import CHECK_TOKENS, FIT_TOKENS, DsaFit, dsa_fit
from torch import nn

__all__ = ["Counts", "count_layer", "count_loss", "count_model", "main", "wrapper_bytes"]

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "llama3_8b": "Llama-3.1-8B",
    "qwen3_30b_a3b": "Qwen3-30B-A3B",
    "qwen3_5_35b_a3b": "Qwen3.5-35B-A3B",
    "glm5": "GLM-5",
}
"""Config files of ``examples/configs/models/`` counted, and their names in the tables."""
SEQ_LEN = 1 << 20
GPUS = (1, 8)
TOKENS_PER_RANK = (8192, 131072)
"""The two local token counts the operator count compares."""
LOSS_TOKENS = 8192
"""Tokens the fused loss is counted on (its FLOPs scaled to the rank's tokens)."""
STYLES = ("fsdp", "ddp")
"""``bf16-mixed`` as FSDP2 runs it (bf16 parameters) and as DDP does (fp32 parameters under autocast)."""

# --------------------------------------------------------------------------------------------------
# One layer, the loss


def read_config(name: str) -> dict[str, Any]:
    """The ``transformers`` config dict of ``examples/configs/models/<name>.json``."""
    return json.loads((ROOT / "examples" / "configs" / "models" / f"{name}.json").read_text())


def layer_kinds(config: dict[str, Any]) -> list[tuple[dict[str, Any], int, int]]:
    """``(config of a small model, index of the counted layer in it, layers of that kind in the model)``
    for every kind of decoder layer: a hybrid's mixer and attention layers; a mixture of experts' expert
    layers (the model's leading dense layers counted as expert layers)."""
    import transformers

    layers = config["num_hidden_layers"]
    # A hybrid's config may leave its layer types to the defaults (Qwen3.5: every fourth full attention).
    types = getattr(transformers.AutoConfig.for_model(**config), "layer_types", None)
    small = {**config, "num_hidden_layers": 1, "first_k_dense_replace": 0}
    small.pop("mlp_layer_types", None)
    if types is None or len(set(types)) == 1:
        return [({**small, **({"layer_types": types[:1]} if types else {})}, 0, layers)]
    kinds = sorted(set(types), key=types.index)
    return [({**small, "layer_types": [kind]}, 0, types.count(kind)) for kind in kinds]


def active_params(layer: nn.Module, experts: int, top_k: int) -> tuple[int, int]:
    """``(N, N_mlp)``: the parameters of ``layer`` one token uses, and of those its MLP's (a routed expert's
    parameters count ``top_k / experts`` of them)."""
    total = mlp = 0.0
    for name, p in layer.named_parameters():
        share = top_k / experts if experts and ".experts." in f".{name}" and "shared" not in name else 1.0
        total += p.numel() * share
        mlp += p.numel() * share if name.startswith("mlp.") else 0
    return int(total), int(mlp)


@dataclass(frozen=True)
class Kind:
    """One kind of decoder layer of a model: its small model's config, the layer's index, how many."""

    config: dict[str, Any]
    index: int
    layers: int
    params: int
    """Parameters a token uses (:func:`active_params`)."""
    mlp_params: int
    attention: bool
    """Softmax attention (else a hybrid's mixer)."""


def kinds(config: dict[str, Any]) -> list[Kind]:
    """:func:`layer_kinds` with each kind's parameter counts (from a model built on ``meta``)."""
    import transformers

    from lightning_cp.plan import ModelShape

    shape = ModelShape.from_hf_config(config)
    found = []
    for small, index, layers in layer_kinds(config):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**small))
        layer = model.model.layers[index]
        params, mlp = active_params(layer, shape.experts, shape.top_k)
        attention = hasattr(layer, "self_attn")
        found.append(Kind(small, index, layers, params, mlp, attention))
    return found


def chosen(config: dict[str, Any], gpus: int, seq_len: int, gpu_bytes: int = 80 * 10**9) -> tuple[Any, bool]:
    """``(candidate, fits)``: the plan's first layout that fits ``gpus`` GPUs of ``gpu_bytes``, else the one
    of smallest peak."""
    from lightning_cp.plan import ModelShape, plan

    candidates = plan(ModelShape.from_hf_config(config), seq_len, gpus)
    fitting = [c for c in candidates if c.fits(gpu_bytes)]
    if fitting:
        return fitting[0], True
    return min(candidates, key=lambda c: c.estimate.peak), False


def wrapper_bytes(params: int, layout: Any) -> int:
    """Bytes a rank sends per step for FSDP's gathers (bf16, forward and backward) and fp32 reduce-scatter,
    or DDP's fp32 all-reduce: the plan's formula (``lightning_cp.plan.terms.wrapper_communication``)."""
    from lightning_cp.plan.terms import ring

    if layout.fsdp:
        return 2 * ring(layout.gpus, params * 2) + ring(layout.gpus, params * 4)
    return 2 * ring(layout.gpus, params * 4)


@dataclass
class Row:
    """One model on one number of GPUs at the plan's layout: every count of the step."""

    model: str
    gpus: int
    layout: str
    fits: bool
    tokens: int
    executed: float = 0.0
    model_flops: float = 0.0
    recompute: float = 0.0
    attention_share: float = 0.0
    ops: dict[int, int] = field(default_factory=dict)
    tiles: dict[int, int] = field(default_factory=dict)
    fp32_share: dict[str, str] = field(default_factory=dict)
    cp_sent: Counter[str] = field(default_factory=Counter)
    plan_cp: int = 0
    wrapper: int = 0
    plan_comm: int = 0
    layer_input_copies: int = 0
    state_copies: int = 0
    plan_host_transfer: int = 0
    mark: str = ""
    """``"³"``: a DSA layer fitted along its blocks (``_dsa_fit``)."""
    notes: list[str] = field(default_factory=list)
    error: str = ""


def count_model(
    name: str, gpus: int, seq_len: int = SEQ_LEN, op_tokens: Sequence[int] = TOKENS_PER_RANK
) -> Row:
    """Every count of :class:`Row` for the model of ``examples/configs/models/<name>.json`` on ``gpus`` GPUs
    at the plan's layout (its step: every layer of each kind, the LM head and the fused loss)."""
    from lightning_cp.memory.tiling import auto_tile_tokens
    from lightning_cp.plan import ModelShape, local_tokens
    from lightning_cp.plan.flops import causal_pairs
    from lightning_cp.plan.terms import loss_chunk_tokens

    config = read_config(name)
    shape = ModelShape.from_hf_config(config)
    candidate, fits = chosen(config, gpus, seq_len)
    layout = candidate.layout
    tokens = local_tokens(seq_len, layout.cp)
    row = Row(MODELS[name], gpus, layout.name(), fits, tokens)
    options = {"checkpointing": layout.checkpointing, "tiled": layout.tiled, "attention": layout.mode()}
    # The model's attention: causal, or the top-k keys of a sparse layer (every layer of a DSA model here).
    pairs = causal_pairs(seq_len, shape.sparse.topk if shape.sparse else seq_len, layout.cp)
    attention_dims = shape.heads * (shape.head_dim + shape.v_head_dim)
    if shape.sparse is not None:  # the indexers' scores, forward only; the recomputation selects again
        sparse = shape.sparse
        scores = 2 * sparse.heads * (sparse.head_dim + 1) * causal_pairs(seq_len, seq_len, layout.cp)
        row.model_flops += sparse.indexer_layers * scores
        row.recompute += sparse.indexer_layers * scores * layout.checkpointing
    dsa: dict[str, DsaFit] = {}  # a DSA layer kind's fit, by its config

    def layer(kind: Kind, t: int) -> Counts:
        if shape.sparse is not None:
            row.mark = "³"
            key = json.dumps(kind.config, sort_keys=True)
            if key not in dsa:
                dsa[key] = dsa_fit(kind.config, kind.index, shape, layout, **options)
            return dsa[key].at(t)
        return count_layer(kind.config, kind.index, cp=layout.cp, tokens=t, **options)

    for kind in kinds(config):
        counts = layer(kind, tokens)
        attention = 6 * attention_dims * pairs if kind.attention else 0
        row.executed += kind.layers * counts.total_flops
        # FlashAttention's calls, or a sparse layer's attention kernel and indexer scores.
        sparse = counts.flops_in["attention"] + counts.flops_in["indexer"]
        row.attention_share += kind.layers * (counts.attention_flops + sparse)
        row.model_flops += kind.layers * (6 * kind.params * tokens + attention)
        forward = 2 * kind.params * tokens + attention // 3
        row.recompute += kind.layers * (
            forward * layout.checkpointing + 2 * kind.mlp_params * tokens * layout.tiled
        )
        for sent_as, nbytes in counts.sent.items():
            row.cp_sent[sent_as] += kind.layers * nbytes
        for t in op_tokens:
            row.ops[t] = row.ops.get(t, 0) + layer(kind, t).ops
            row.tiles[t] = math.ceil(t / auto_tile_tokens(t, shape.hidden)) if layout.tiled else 0
    small = min(op_tokens)
    first = kinds(config)[0]
    for style in STYLES:
        try:
            counts = count_layer(first.config, 0, cp=layout.cp, tokens=small, style=style)
        except RuntimeError as error:  # e.g. _grouped_mm refuses fp32 experts under DDP's autocast
            row.fp32_share[style] = f"refused: {str(error).splitlines()[0][:80]}"
            continue
        loss = count_loss(config, small, style, chunk_size=loss_chunk_tokens(shape, small))
        fp32 = counts.flops["torch.float32"] + loss.flops["torch.float32"]
        row.fp32_share[style] = f"{fp32 / (counts.total_flops + loss.total_flops):.2%}"
    # The loss's FLOPs are linear in the tokens: counted on LOSS_TOKENS (its CPU path loops over chunks and
    # vocabulary blocks, which one Triton kernel does on a GPU), scaled to the rank's.
    loss = count_loss(config, LOSS_TOKENS, chunk_size=loss_chunk_tokens(shape, tokens))
    row.executed += loss.total_flops * tokens // LOSS_TOKENS
    row.model_flops += 6 * shape.vocab * shape.hidden * tokens
    row.attention_share /= max(1, row.executed)
    estimate = candidate.estimate
    row.wrapper = wrapper_bytes(shape.params, layout)
    row.plan_comm = estimate.communication
    row.plan_cp = estimate.communication - row.wrapper
    # Offload: every layer's bf16 input [T_local, hidden] out in the forward and back in the backward.
    row.layer_input_copies = 2 * shape.layers * tokens * shape.hidden * 2 if layout.offload else 0
    # cpu_offload: the parameter shards in for the forward and the backward, the gradient shards out.
    row.state_copies = 3 * math.ceil(shape.params / layout.gpus) * 4 if layout.cpu_offload else 0
    row.plan_host_transfer = estimate.host_transfer
    for kind in kinds(config) if dsa else []:  # the same kinds, as layer() fitted them
        model_attention = 6 * attention_dims * pairs * (3 + layout.checkpointing) // 3
        fit = dsa[json.dumps(kind.config, sort_keys=True)]
        row.notes += _dsa_notes(fit, kind.layers, row, model_attention, loss)
    return row


def _dsa_notes(fit: DsaFit, layers: int, row: Row, model_attention: int, loss: Counts) -> list[str]:
    """What a DSA layer kind's fitted counts say beyond the tables: the fit's check, the operators at the
    rank's tokens by region, the indexer's and the absorbed attention's share of the step's FLOPs (``layers``
    such layers; ``model_attention``: the model's attention FLOPs of one, its recomputation included), the
    step without them, the fp32 share at the rank's tokens (``loss`` counted on :data:`LOSS_TOKENS`)."""
    ops_error, flops_error = fit.check_error()
    at = fit.at(row.tokens)
    indexer, attention = (layers * at.flops_in[region] for region in ("indexer", "attention"))
    rest = row.executed - attention + layers * model_attention
    fp32 = layers * at.flops["torch.float32"] + loss.flops["torch.float32"] * row.tokens / LOSS_TOKENS
    fp32_of = {
        region: at.fp32_in[region] / max(1, at.flops_in[region]) for region in ("indexer", "attention")
    }

    fitted_on = ", ".join(f"{t:,}" for t in FIT_TOKENS)
    return [
        (
            f"fitted on {fitted_on} tokens per rank; at {CHECK_TOKENS:,} the fit is off the count by "
            f"{ops_error:+.3%} in operators and {flops_error:+.4%} in FLOPs"
        ),
        (
            f"operators per layer at the rank's {row.tokens:,} tokens: {at.ops:,} (indexer "
            f"{at.ops_in['indexer']:,}, top-k attention kernel {at.ops_in['attention']:,}, the rest "
            f"{at.ops_in['layer']:,})"
        ),
        (
            f"of the executed FLOPs the indexer's scores are {indexer / row.executed:.1%}, the absorbed top-k "
            f"attention's {attention / row.executed:.1%} ({at.flops_in['attention'] / model_attention:.2f}x the "
            f"model's, expanded); with the model's attention in its place, executed / (model + recompute) = "
            f"{rest / (row.model_flops + row.recompute):.3f}"
        ),
        (
            f"fp32 share of the matmul FLOPs at the rank's tokens (FSDP2 style, layers + loss): "
            f"{fp32 / row.executed:.2%} (of the indexer's scores {fp32_of['indexer']:.1%}, of the top-k "
            f"attention's {fp32_of['attention']:.1%})"
        ),
    ]


# --------------------------------------------------------------------------------------------------
# The tables

GIB = 2**30


def _tables(rows: list[Row]) -> str:
    ok = [r for r in rows if not r.error]
    lines = [
        (
            "| model | GPUs | layout (plan) | tokens/rank | executed PFLOP | model PFLOP | recompute PFLOP "
            "| executed / (model + recompute) | attention share |"
        ),
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in ok:
        fit = "" if r.fits else " (fits no 80 GB GPU)"
        ratio = r.executed / (r.model_flops + r.recompute)
        lines.append(
            f"| {r.model}{r.mark} | {r.gpus} | `{r.layout}`{fit} | {r.tokens:,} | {r.executed / 1e15:,.1f} | "
            f"{r.model_flops / 1e15:,.1f} | {r.recompute / 1e15:,.1f} | {ratio:.3f} | {r.attention_share:.2f} |"
        )
    small, large = TOKENS_PER_RANK
    lines += [
        "",
        (
            f"| model | GPUs | operators per layer (one of each kind) @ {small // 1024}K | @ {large // 1024}K | ratio | tiles @ "
            f"{small // 1024}K / {large // 1024}K | fp32 share of matmul FLOPs, FSDP2 / DDP |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in ok:
        lines.append(
            f"| {r.model}{r.mark} | {r.gpus} | {r.ops[small]:,} | {r.ops[large]:,} | {r.ops[large] / r.ops[small]:.2f} | "
            f"{r.tiles[small]} / {r.tiles[large]} | {r.fp32_share['fsdp']} / {r.fp32_share['ddp']} |"
        )
    lines += [
        "",
        (
            "| model | GPUs | CP all-gather GiB | CP reduce-scatter GiB | CP all-to-all GiB | counted CP GiB | plan's CP "
            "GiB | FSDP/DDP GiB (plan's formula) | plan comm GiB | layer inputs h2d+d2h GiB | model state h2d+d2h GiB | "
            "plan h2d+d2h GiB |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in ok:
        sent = [r.cp_sent[k] / GIB for k in ("all_gather", "reduce_scatter", "all_to_all")]
        lines.append(
            f"| {r.model}{r.mark} | {r.gpus} | {sent[0]:,.1f} | {sent[1]:,.1f} | {sent[2]:,.1f} | {sum(sent):,.1f} | "
            f"{r.plan_cp / GIB:,.1f} | {r.wrapper / GIB:,.1f} | {r.plan_comm / GIB:,.1f} | "
            f"{r.layer_input_copies / GIB:,.1f} | {r.state_copies / GIB:,.1f} | {r.plan_host_transfer / GIB:,.1f} |"
        )
    for r in ok:
        lines += [""] + [f"- {r.model}{r.mark}, {r.gpus} GPUs: {note}" for note in r.notes] if r.notes else []
    failed = [r for r in rows if r.error]
    if failed:
        lines.append("")
        lines += [f"- {r.model}, {r.gpus} GPUs (`{r.layout}`): not counted: {r.error}" for r in failed]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """Count every model on every number of GPUs; print the tables (Markdown with ``--markdown``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--gpus", nargs="+", type=int, default=list(GPUS))
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = []
    for name in args.models:
        for gpus in args.gpus:
            try:
                rows.append(count_model(name, gpus, args.seq_len))
            except Exception as error:  # noqa: BLE001  (a model the fake run cannot take is its row)
                rows.append(
                    Row(MODELS[name], gpus, "-", False, 0, error=f"{type(error).__name__}: {error}"[:200])
                )
    tables = _tables(rows)
    print(tables if args.markdown else tables.replace("|", " "))
    print(f"\n{args.seq_len:,} tokens per sequence, {time.perf_counter() - started:.0f} s")
    return rows


if __name__ == "__main__":
    main()
