"""Self-checks of the hybrid token mixers under CP: every rank's adapted layer against the layer on each document.

One layer of each mixer kind the package adapts (:mod:`lightning_cp.hf.mixers`), from a tiny ``transformers``
model: Gated DeltaNet (Qwen3.5), Mamba2 and a short convolution (LFM2). The layer, adapted for a CP group
of 4, runs on every rank's shard of a packed row of documents (of one token, shorter and longer than a chunk)
through the head-parallel exchange (:mod:`lightning_cp.doctor._ranks`: all ranks simulated in this process,
or this rank of the real group under ``torchrun``), forward and backward; the output and the input gradient
of the real tokens, and the parameters' gradients summed over the ranks, are compared with those of the
layer itself on each whole document alone, in float64 on the CPU. The layer's kernels are the ones
``transformers`` picks (its torch kernels; ``fla``, ``causal-conv1d``, ``mamba-ssm`` where installed).
Weights are drawn at 10x ``transformers``' default range, so a mistake is far above the rounding.

The checks run in fp32 only: the exchange moves the same values in any dtype, and in bf16 these layers'
own error against float64 (``transformers``' Gated DeltaNet kernel: 0.8% at the default weights, 5% at
these) leaves no room under the doctor's 1% cap.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_cp.doctor._compare import CheckResult, compare, dtype_name, run_check
from lightning_cp.doctor._ranks import CheckRanks, SimulatedRanks
from lightning_cp.parallel import shard_batch

DTYPE = torch.float32
"""The dtype of the layers and their inputs (see the module docstring)."""
CP = 4
"""The CP size of the simulated group (and the one the layers are built to split over)."""
HIDDEN = 64
DOCUMENTS = (5, 1, 16, 9)
"""The packed row: 16 is a multiple of ``2 * CP``, so no padding separates it from the next document."""
_COMMON = {"hidden_size": HIDDEN, "vocab_size": 32, "initializer_range": 0.2, "num_hidden_layers": 2}
MIXERS: dict[str, tuple[dict, str, tuple[str, ...]]] = {
    "gated_deltanet": (
        {
            "model_type": "qwen3_5_text",
            **_COMMON,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_key_heads": 2,  # fewer key heads than ranks: several ranks read each
            "linear_num_value_heads": 8,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_conv_kernel_dim": 4,
            "layer_types": ["linear_attention", "full_attention"],
        },
        "model.layers.0.linear_attn",
        ("fla", "causal_conv1d"),
    ),
    "mamba2": (
        {
            "model_type": "mamba2",
            **_COMMON,
            "num_heads": 8,
            "head_dim": 16,
            "expand": 2,
            "n_groups": 2,
            "state_size": 8,
            "chunk_size": 8,  # several scan chunks per document
            "time_step_rank": 8,
        },
        "backbone.layers.0.mixer",
        ("mamba_ssm", "causal_conv1d"),
    ),
    "short_conv": (
        {
            "model_type": "lfm2",
            **_COMMON,
            "intermediate_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "layer_types": ["conv", "full_attention"],
            "block_auto_adjust_ff_dim": False,
        },
        "model.layers.0.conv",
        ("causal_conv1d",),
    ),
}
"""Each kind: a tiny model's configuration (its heads split over 2, 4 and 8 ranks), where its first mixer
sits, and the packages of the CUDA kernels ``transformers`` uses for it where installed."""


NO_TRANSFORMERS = "transformers not installed (pip install lightning-cp[hf])"


def kernel_packages(kind: str) -> str:
    """Which CUDA kernel packages of ``kind`` are installed, e.g. ``fla: installed, causal_conv1d: missing``."""
    return ", ".join(
        f"{package}: {'installed' if importlib.util.find_spec(package) else 'missing'}"
        for package in MIXERS[kind][2]
    )


def mixer_config(kind: str, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    """The configuration of the tiny model of ``kind``, with ``sizes`` over it (a wider layer, say)."""
    return {**MIXERS[kind][0], **(sizes or {})}


def mixer_layer(kind: str, dtype: torch.dtype, sizes: dict[str, Any] | None = None) -> nn.Module:
    """The first mixer of the model of ``kind`` (:func:`mixer_config`) on the CPU in ``dtype``, the same weights
    on every call."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**mixer_config(kind, sizes))
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.get_submodule(MIXERS[kind][1]).to(dtype)


def split_problem(kind: str, cp: int) -> str | None:
    """Why the layer of ``kind`` cannot be split over ``cp`` ranks (its mixer description's words), or ``None``."""
    from lightning_cp.hf.mixers import mixer_shape

    return mixer_shape(mixer_layer(kind, DTYPE)).split_problem(cp)


def _on_documents(
    layer: nn.Module, hidden: Tensor, weight: Tensor, documents: Sequence[int]
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, d hidden, d parameters)`` of the layer on each document of ``hidden`` ``[1, T, H]`` alone, for the
    loss ``sum(out * weight)``; in the layer's dtype and device."""
    x = hidden.detach().clone().requires_grad_()
    out = torch.cat([layer(piece) for piece in x.split(list(documents), dim=1)], dim=1)
    params = list(layer.parameters())
    grads = torch.autograd.grad(out, [x, *params], weight, allow_unused=True)
    return out.detach(), grads[0], _flat(grads[1:], params)


def _flat(grads: Sequence[Tensor | None], params: list[Tensor]) -> Tensor:
    """Every parameter's gradient flattened into one vector (zeros for a parameter without one)."""
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)])


def mixer_triples(
    ranks: CheckRanks,
    device: torch.device,
    layer: nn.Module,
    hidden: Tensor,
    weight: Tensor,
    documents: Sequence[int],
    reference: tuple[torch.dtype, torch.device] = (torch.float64, torch.device("cpu")),
) -> tuple[dict[str, tuple[Tensor, Tensor, Tensor]], list[str]]:
    """A copy of ``layer`` adapted for CP, on the shards of ``ranks`` on ``device``, and the layer on each
    document alone in the ``reference`` dtype and device and in its own dtype on ``device``.

    Args:
        layer: a mixer :data:`ADAPTERS <lightning_cp.hf.mixers.ADAPTERS>` knows, on the CPU (not changed).
        hidden, weight: ``[1, T, H]`` on the CPU in the layer's dtype: the packed row of ``documents`` and the
            weights of the loss ``sum(out * weight)``.

    Returns:
        ``{quantity: (ours, reference, PyTorch's)}`` for ``out`` and ``dx`` (the real tokens of the ranks run
        here, ``[n, H]`` on the CPU) and ``dparams`` (every parameter's gradient summed over the ranks, one
        vector); and the exchanges rank ``ranks.ranks[0]``'s forward made.
    """
    from lightning_cp.hf.mixers import adapt_token_mixers

    ref_dtype, ref_device = reference
    cast = (ref_device, ref_dtype)
    references = _on_documents(copy.deepcopy(layer).to(*cast), hidden.to(*cast), weight.to(*cast), documents)
    torchs = _on_documents(copy.deepcopy(layer).to(device), hidden.to(device), weight.to(device), documents)
    ours = copy.deepcopy(layer).to(device)
    adapt_token_mixers(ours, ranks.cp)
    params = list(ours.parameters())
    cu = torch.tensor([0, *itertools.accumulate(documents)])

    def row(
        tensors: dict[str, Tensor], where: torch.device
    ) -> dict[str, Tensor]:  # the packed batch on `where`
        return {
            "input_ids": torch.zeros(1, hidden.shape[1], dtype=torch.long, device=where),
            "cu_seqlens": cu,
            **tensors,
        }

    mine = row({"h": hidden.to(device), "w": weight.to(device)}, device)
    shards = {rank: shard_batch(mine, ranks.cp, rank, cp_group=ranks.exchange(rank)) for rank in ranks.ranks}
    expected = {"ref_out": references[0], "ref_dx": references[1]}
    expected.update({"torch_out": torchs[0].to(*cast), "torch_dx": torchs[1].to(*cast)})
    wanted = {rank: shard_batch(row(expected, ref_device), ranks.cp, rank) for rank in ranks.ranks}
    inputs = {rank: shard["h"].clone().requires_grad_() for rank, shard in shards.items()}

    def forward_step(rank: int) -> Tensor:
        return ours(inputs[rank], cp_shard=shards[rank]["cp_shard"])

    outs = dict(zip(ranks.ranks, ranks.run(forward_step)))
    forward = ranks.calls[ranks.ranks[0]].copy()

    def backward_step(rank: int) -> tuple[Tensor | None, ...]:
        return torch.autograd.grad(
            outs[rank], [inputs[rank], *params], shards[rank]["w"], retain_graph=True, allow_unused=True
        )

    grads = dict(zip(ranks.ranks, ranks.run(backward_step)))
    dparams = ranks.sum([_flat(grads[rank][1:], params) for rank in ranks.ranks])
    triples: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
    for quantity, results in (("out", outs), ("dx", {rank: grads[rank][0] for rank in ranks.ranks})):
        per_rank = []
        for rank in ranks.ranks:
            valid = wanted[rank]["input_mask"].bool().cpu()  # the padding added by the split is not compared
            triple = (results[rank], wanted[rank][f"ref_{quantity}"], wanted[rank][f"torch_{quantity}"])
            per_rank.append(tuple(t.detach().cpu()[valid] for t in triple))
        triples[quantity] = tuple(torch.cat(parts) for parts in zip(*per_rank))
    triples["dparams"] = (dparams.cpu(), references[2].cpu(), torchs[2].cpu())
    return triples, forward


def check_mixer(name: str, ranks: CheckRanks, device: torch.device, kind: str) -> CheckResult:
    """The adapted mixer of ``kind`` on the shards of ``ranks`` against the layer on each whole document, in
    :data:`DTYPE` (float64 reference on the CPU); a FAIL when its forward made other exchanges than
    all-to-alls."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, sum(DOCUMENTS), HIDDEN, generator=g).to(DTYPE)
    weight = torch.randn(hidden.shape, generator=g).to(DTYPE)
    triples, forward = mixer_triples(ranks, device, mixer_layer(kind, DTYPE), hidden, weight, DOCUMENTS)
    exchanges = f"fwd: {', '.join(forward) or 'no exchange'}"
    if not forward or set(forward) != {"all_to_all"}:
        return CheckResult(name, "FAIL", f"{exchanges}; the head-parallel exchange is an all-to-all")
    return compare(name, DTYPE, triples, f"[{kernel_packages(kind)}; {exchanges}]")


def mixer_names(cp: int) -> dict[str, str]:
    """The check line's name of each mixer kind at ``cp``."""
    return {kind: f"mixer {kind} cp={cp} packed {dtype_name(DTYPE)}" for kind in MIXERS}


def mixer_checks(device: torch.device) -> list[CheckResult]:
    """One result per mixer kind, in :data:`DTYPE`: every rank of a simulated group of :data:`CP` vs the layer
    on each document; SKIP lines without ``transformers``."""
    names = mixer_names(CP)
    if importlib.util.find_spec("transformers") is None:
        return [CheckResult(name, "SKIP", NO_TRANSFORMERS) for name in names.values()]
    return [run_check(name, _simulated, device, kind) for kind, name in names.items()]


def _simulated(name: str, device: torch.device, kind: str) -> CheckResult:
    return check_mixer(name, SimulatedRanks(CP), device, kind)
