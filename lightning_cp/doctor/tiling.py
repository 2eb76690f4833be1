"""Self-checks of the tiling (:func:`lightning_cp.memory.tile_model`, the plan's ``+tiled``): a model tiled in
tiles shorter than its sequences against the same model untiled.

A tiny :class:`~lightning_cp.models.GPT` (one block) runs a batch of :data:`TOKENS`-token sequences, and a copy
of it tiled by :func:`~lightning_cp.memory.tile_model` at :data:`TILE` tokens per tile (three tiles, the last
one shorter): its MLPs and norms run tile by tile, without a graph, and are recomputed tile by tile in the
backward; the projections that read a norm recompute its output by tiles. The hidden states and every
parameter's gradient of the loss ``sum(out * weight)`` are compared with the untiled model's, in float32, and
with fp32 parameters under bf16 autocast (the backward's recomputation must run under the forward's autocast);
the reference is the untiled model in float64 on the CPU. A check also fails when the MLPs did not run in tiles
(the calls of their first layer are counted, in the forward and in the backward): an untiled model would pass
the numbers.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor

from lightning_cp.doctor._autocast import AUTOCAST, MatmulDtypes, autocast
from lightning_cp.doctor._compare import CheckResult, compare, dtype_name, run_check
from lightning_cp.memory import tile_model
from lightning_cp.models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=96, n_layer=1, n_head=4, n_embd=64)
BATCH, TOKENS, TILE = 2, 40, 16
"""Two sequences of 40 tokens, in tiles of 16: two whole tiles and a shorter one."""


def tiling_checks(device: torch.device) -> list[CheckResult]:
    """Two results: the tiled GPT in float32, and under :data:`~lightning_cp.doctor._autocast.AUTOCAST`
    autocast, vs the untiled one (see the module docstring)."""
    results = []
    for low in (None, AUTOCAST):
        name = f"tiling gpt {TOKENS} tokens in tiles of {TILE} float32"
        name += f" under {dtype_name(low)} autocast" if low else ""
        results.append(run_check(name, _check, device, low))
    return results


def _inputs() -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, position_ids, weight)``: ``[B, T]``, ``[B, T]`` and the loss's ``[B, T, n_embd]`` (fp32)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, TOKENS), generator=g)
    positions = torch.arange(TOKENS).expand(BATCH, -1)
    return ids, positions, torch.randn(BATCH, TOKENS, CONFIG.n_embd, generator=g)


class _Calls:
    """Counts the calls of each block's first MLP layer per layer, in the forward and in the backward: one per
    tile in each when the MLPs run tiled (the backward recomputes them), one in the forward otherwise."""

    def __init__(self, model: GPT) -> None:
        self.counts = [0]
        for block in model.blocks:
            block.mlp[0].register_forward_hook(self._called)

    def _called(self, *args: object) -> None:
        self.counts[-1] += 1

    def backward(self) -> None:
        """Count the calls from now on as the backward's."""
        self.counts.append(0)

    def per_layer(self) -> tuple[float, ...]:
        return tuple(count / CONFIG.n_layer for count in self.counts)


def _run(
    model: GPT,
    device: torch.device,
    dtype: torch.dtype,
    low: torch.dtype | None = None,
    calls: _Calls | None = None,
) -> dict[str, Tensor]:
    """``{"out": hidden states, "d<parameter>": its gradient, ...}`` of ``model`` on :func:`_inputs` (the
    forward under ``low`` autocast when given), on the CPU; ``calls`` told when the backward starts."""
    ids, positions, weight = (t.to(device) for t in _inputs())
    with autocast(device, low):
        out = model(ids, positions)
    if calls is not None:
        calls.backward()
    (out * weight.to(dtype)).sum().backward()
    grads = {f"d{name}": p.grad.detach().cpu() for name, p in model.named_parameters()}
    return {"out": out.detach().cpu(), **grads}


def _check(name: str, device: torch.device, low: torch.dtype | None) -> CheckResult:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = _run(copy.deepcopy(model).double(), torch.device("cpu"), torch.float64)
    torchs = _run(copy.deepcopy(model).to(device), device, torch.float32, low)
    tiled = copy.deepcopy(model).to(device)
    tile_model(tiled, TILE)
    calls = _Calls(tiled)
    with MatmulDtypes(low or torch.float32) as matmuls:
        ours = _run(tiled, device, torch.float32, low, calls)
    tiles = math.ceil(TOKENS / TILE)
    forward, backward = calls.per_layer()
    ran = f"mlp calls per layer: {forward:g} fwd, {backward:g} bwd"
    if (forward, backward) != (tiles, tiles):
        return CheckResult(name, "FAIL", f"{ran}; {tiles} tiles of {TILE} tokens make {tiles} each")
    triples = {quantity: (ours[quantity], reference[quantity], torchs[quantity]) for quantity in reference}
    result = compare(name, low or torch.float32, triples, f"[{ran}]")
    return result if low is None else matmuls.verdict(result)
