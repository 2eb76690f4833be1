"""The GPU proof's ``layers`` section: one decoder layer per planned layout, its peak against the plan's term.

For Llama-3.1-8B (``examples/configs/models/llama3_8b.json``) at 1M tokens the plan picks a layout on one GPU
and one on eight (:func:`planned_layouts`). Each runs one decoder layer at the model's width as one CP rank
does (:func:`layer_rank`: rank 0, its peers simulated by
:class:`~lightning_cp.parallel.simulated.SimulatedCPGroup` as ``benchmarks/hybrid.py`` does, the layout's
attention, checkpointing, offload and tiling), forward and backward, and ``torch.cuda.max_memory_allocated``
above what was allocated before (the layer's parameters and their gradients, its input and the incoming
gradient) is set against the plan's term for that layer (:func:`planned_layer_term`, at the tokens run). A
rank of one GPU at 1M tokens runs its causal attention over 1M tokens, over a minute and a half on an H100:
the tokens per rank are capped at :data:`LAYER_MAX_TOKENS`, and the plan is evaluated at those same tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from _probes import MIB
from _report import STATUS, Column, format_table
from _section_base import ROOT, Row, Section, verdict

LAYER_MODEL = ROOT / "examples" / "configs" / "models" / "llama3_8b.json"
LAYER_SEQ_LEN = 2**20
LAYER_GPUS = (1, 8)
LAYER_GPU_BYTES = 80 * 10**9
"""The GPU the layouts are planned for: 80 GB, ``lightning-cp plan``'s default (an H100)."""
LAYER_MAX_TOKENS = 131072
"""Tokens per rank run at most: the 8-GPU layout's own (1M / 8); one GPU's 1M would take minutes."""
LAYER_TARGET = 1.1
"""The measured peak at most this times the plan's term (10% over: FAIL naming the term)."""


def planned_layouts(shape: Any, seq_len: int = LAYER_SEQ_LEN, gpus: Sequence[int] = LAYER_GPUS) -> list[Any]:
    """The candidate the plan picks for ``shape`` (a ``ModelShape``) at ``seq_len`` tokens on each number of
    ``gpus`` of :data:`LAYER_GPU_BYTES`: the first that fits, or, when none does (Llama-3.1-8B on one GPU at
    1M: it fits 992,256 tokens), the one with the smallest peak."""
    from lightning_cp.plan import plan

    chosen = []
    for count in gpus:
        candidates = plan(shape, seq_len, count)
        fitting = [c for c in candidates if c.fits(LAYER_GPU_BYTES)]
        chosen.append(fitting[0] if fitting else min(candidates, key=lambda c: c.estimate.peak))
    return chosen


def planned_layer_term(
    shape: Any, layout: Any, tokens: int, precision: str = "bf16-mixed"
) -> tuple[str, int]:
    """The plan's term for one decoder layer's forward + backward of ``tokens`` per rank under ``layout``: its
    name and bytes, for a model of one such layer (no previous layer to prefetch under offload).

    Checkpointed: ``recompute`` (the rebuilt saved tensors and the layer's largest transient; the saved input
    is among the activations). Otherwise what the layer saves (and autocast's weight copies) and the larger of
    its attention and MLP transients, as the peak counts them."""
    from lightning_cp.plan import estimate, local_tokens
    from lightning_cp.plan.terms import Step, layer_saved

    one = replace(shape, layers=1)
    seq_len = tokens * layout.cp
    planned = estimate(one, seq_len, layout, precision=precision)
    if layout.checkpointing:
        return "recompute", planned.recompute
    saved = layer_saved(Step(one, layout, precision, "cuda", True, local_tokens(seq_len, layout.cp)))
    name = max(("attention", "mlp"), key=planned.counted_transient)
    return f"layer saved + {name}", saved.attention_layer + saved.weight_copies + planned.counted_transient(
        name
    )


def _one_layer_model(config: dict[str, Any], layout: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A ``transformers`` model of one decoder layer of ``config`` on ``device``, with ``layout``'s tiling,
    checkpointing and offload, no final norm (the layer's output is the model's): parameters in ``dtype``
    under FSDP (what its mixed precision gathers), fp32 under DDP (autocast casts them)."""
    import transformers

    import lightning_cp  # noqa: F401  (registers attn_implementation="lightning_cp")
    from lightning_cp.memory import tile_model
    from lightning_cp.strategies._modules import apply_checkpointing

    torch.manual_seed(0)  # the same weights in every build: a layout's savings must not change the layer
    fields = {**config, "num_hidden_layers": 1, "vocab_size": 64, "tie_word_embeddings": False}
    hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="lightning_cp", dtype=dtype if layout.fsdp else torch.float32
        )
    model.train()
    model.tiled = tile_model(model) if layout.tiled else []
    model.model.norm = torch.nn.Identity()
    if layout.checkpointing:
        model.offload = apply_checkpointing(model, [type(model.model.layers[0])], offload=layout.offload)
    return model


def layer_rank(
    config: dict[str, Any],
    layout: Any,
    tokens: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Row, torch.Tensor]:
    """Rank 0 of ``layout``'s CP group running one decoder layer of ``config`` (a ``transformers`` config's
    fields) on ``tokens`` local tokens of one sequence, forward + backward, under the layout's attention,
    tiling, checkpointing and offload (:func:`_one_layer_model`), its peers simulated (their data zeros, their
    work not done; every collective answers with a stand-in of the right size). On CUDA, ``peak_bytes``:
    ``torch.cuda.max_memory_allocated`` above what was allocated before (the parameters and their gradients,
    the input, the incoming gradient), less the layer's output (the next layer's input: among the plan's
    activations); elsewhere ``None``. Also the seconds, the bytes offloaded and the modules tiled; and the
    input's gradient."""
    from lightning_cp.parallel import shard_batch
    from lightning_cp.parallel.simulated import SimulatedCPGroup

    model = _one_layer_model(config, layout, device, dtype)
    stream = dtype if layout.fsdp else torch.float32
    for (
        parameter
    ) in model.parameters():  # accumulated in place: the gradients are model state, not the layer's
        parameter.grad = torch.zeros_like(parameter)
    group = SimulatedCPGroup(layout.cp, sum_key_gradients=False)
    ids = torch.zeros(1, tokens * layout.cp, dtype=torch.long, device=device)
    shard = shard_batch({"input_ids": ids}, layout.cp, 0, cp_group=group.exchange(0), attention=layout.mode())
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(1, tokens, config["hidden_size"], generator=g, device=device, dtype=stream)
    grad = torch.randn(x.shape, generator=g, device=device, dtype=stream)
    x.requires_grad_()
    autocast = torch.autocast(device.type, dtype, enabled=not layout.fsdp and dtype != torch.float32)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    began = time.perf_counter()
    with group.recording(), autocast:
        out = model.model(
            inputs_embeds=x, position_ids=shard["position_ids"], cp_shard=shard["cp_shard"], use_cache=False
        ).last_hidden_state
        out.backward(grad)
    if cuda:
        torch.cuda.synchronize(device)
    offload = getattr(model, "offload", None)
    row = {
        "layout": layout.name(),
        "tokens": tokens,
        "peak_bytes": torch.cuda.max_memory_allocated(device) - before - out.nbytes if cuda else None,
        "seconds": time.perf_counter() - began,
        "offloaded_bytes": offload.stats.offloaded_bytes if offload is not None else 0,
        "tiled_modules": len(model.tiled),
    }
    return row, x.grad


def judge_layer(row: Row) -> None:
    """Set ``row``'s ratio of the measured peak to the plan's term, its verdict (at most :data:`LAYER_TARGET`)
    and status: ``PASS``, or ``FAIL: <term> ...`` naming the term the layer outgrew."""
    row["x_plan"] = row["peak_bytes"] / row["planned_bytes"]
    row["target"] = verdict(row["x_plan"], LAYER_TARGET)
    if row["x_plan"] <= LAYER_TARGET:
        row["status"] = "PASS"
        return
    measured, planned = row["peak_bytes"] / MIB, row["planned_bytes"] / MIB
    row["status"] = f"FAIL: {row['term']} {measured:,.0f} MiB measured, {planned:,.0f} MiB planned"


def layers_verdict(rows: Sequence[Row]) -> Section:
    """PASS when every layout's layer is within its term; FAIL naming each one that is not (or did not run)."""
    failed = [f"{row['layout']}: {row['status']}" for row in rows if row["status"] != "PASS"]
    if failed:
        return Section("FAIL", "; ".join(failed))
    return Section("PASS", "; ".join(f"{row['layout']}: {row['term']} {row['target']}" for row in rows))


_LAYER_COLUMNS = (
    Column("GPUs", "gpus", "d"),
    Column("layout (planned at 1M)", "layout", align="<"),
    Column("tokens / rank at 1M", "full_tokens", ",d"),
    Column("tokens / rank run", "tokens", ",d"),
    Column("plan's term", "term", align="<"),
    Column("planned MiB", "planned_bytes", ",.0f", scale=MIB),
    Column("measured MiB", "peak_bytes", ",.0f", scale=MIB),
    Column(f"x plan (<= {LAYER_TARGET:g})", "target", align="<"),
    Column("offloaded MiB", "offloaded_bytes", ",.0f", scale=MIB),
    Column("tiled modules", "tiled_modules", "d"),
    Column("seconds", "seconds", ",.1f"),
    STATUS,
)


def layers(device: torch.device) -> Section:
    from lightning_cp.plan import ModelShape, local_tokens

    config = json.loads(LAYER_MODEL.read_text())
    shape = ModelShape.from_hf_config(config)
    rows = []
    for gpus, chosen in zip(LAYER_GPUS, planned_layouts(shape)):
        layout = chosen.layout
        full = local_tokens(LAYER_SEQ_LEN, layout.cp)
        tokens = min(full, LAYER_MAX_TOKENS)
        term, planned = planned_layer_term(shape, layout, tokens, chosen.precision)
        row: Row = {"gpus": gpus, "layout": layout.name(), "full_tokens": full, "term": term}
        try:
            row.update(layer_rank(config, layout, tokens, device)[0], planned_bytes=planned)
            judge_layer(row)
        except Exception as error:  # noqa: BLE001  (one layout's failure is its row; the other still runs)
            row["status"] = f"FAIL: {type(error).__name__}: {error}"[:300]
        torch.cuda.empty_cache()
        rows.append(row)
    body = (
        f"One decoder layer of Llama-3.1-8B (`{LAYER_MODEL.relative_to(ROOT)}`, bf16-mixed) per layout the plan "
        f"picks at {LAYER_SEQ_LEN:,} tokens on {LAYER_GPU_BYTES / 1e9:.0f} GB GPUs (one GPU: none fits, the one "
        "with the smallest peak), as rank 0 of its CP group with simulated peers; forward + backward once. "
        "Measured: `torch.cuda.max_memory_allocated` above the parameters, their gradients, the input and the "
        "incoming gradient, less the layer's output. Planned: the term of a one-layer model at the tokens run "
        f"(at most {LAYER_MAX_TOKENS:,} per rank).\n\n" + format_table(rows, _LAYER_COLUMNS, markdown=True)
    )
    result = layers_verdict(rows)
    return Section(result.status, result.summary, body)
