"""Token-wise modules computed over tiles of the sequence: only their input is saved for the backward.

An MLP (GPT's ``Linear -> GELU -> Linear``, a SwiGLU ``down(act(gate(x)) * up(x))``) and a norm (RMSNorm,
LayerNorm: over the last dim) act on every token alone, so running them on tiles of the tokens gives the
same output. :func:`tiled_mlp` runs the tiles one after another without building a graph and saves only
its input; the backward recomputes each tile's forward and back-propagates through it, summing the
parameters' gradients over the tiles in fp32. One tile's intermediates are alive at a time (forward and backward),
instead of the whole ``[T_local, ffn]`` ones autograd would keep for an MLP, or a norm's fp32 copies of its
input and its normalized input. The price is one extra forward of the module in the backward (as with
activation checkpointing, which recomputes the layer anyway; tiled inside a checkpointed layer, it runs
twice).

:func:`tile_mlps` and :func:`tile_norms` make a model's MLPs and norms run so (the plan's ``+tiled``).

No communication: the tiles are this rank's tokens. The parameters' gradients are returned by the
autograd function (once per step, not per tile), so DDP's gradient hooks fire as usual; the recomputation
runs under the autocast state of the forward.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor, nn


def auto_tile_tokens(tokens: int, model_dim: int) -> int:
    """Tokens per tile: ``tokens`` in ``ceil(tokens / model_dim)`` tiles of equal size (the last one
    shorter), so that a tile has at most ``model_dim`` tokens and one tile's ``[tile, ffn]`` intermediate is
    no larger than the MLP's ``[ffn, model_dim]`` weight, whatever the sequence length (DeepSpeed ALST's
    TiledMLP splits a sequence into ``ceil(seqlen / hidden_size)`` shards, arXiv:2506.13996)."""
    tiles = max(1, math.ceil(tokens / max(1, model_dim)))
    return max(1, math.ceil(tokens / tiles))


def tiled_mlp(mlp: nn.Module, x: Tensor, tile_tokens: int | None = None) -> Tensor:
    """``mlp(x)`` computed over tiles of ``x``'s second-to-last (token) dim, with the same result; only ``x``
    is saved for the backward.

    Args:
        mlp: a module that maps every token alone (``[..., T, d] -> [..., T, d_out]``) to one tensor.
        x: ``[..., T, d]`` (``[B, S, d]`` or ``[T, d]``).
        tile_tokens: tokens per tile; ``None``: :func:`auto_tile_tokens`.

    Returns:
        ``mlp(x)``, differentiable in ``x`` and in ``mlp``'s parameters.
    """
    return _tiled(mlp, mlp, [x], tile_tokens)


def tile_mlps(model: nn.Module, tile_tokens: int | None = None, *, name: str = "mlp") -> list[str]:
    """Make every dense submodule named ``name`` (GPT's and ``transformers``' decoder layers call theirs
    ``mlp``) run through :func:`tiled_mlp`; returns their qualified names. A mixture of experts stays whole
    (:func:`tile_experts` tiles it).

    The modules stay where they are (the forward of each instance is replaced), so parameter names,
    checkpoints and FSDP units are unchanged. Call it once, before training (``configure_model``).

    Raises:
        ValueError: when ``model`` has no such submodule.
    """
    named = [
        (qualified, module) for qualified, module in model.named_modules() if qualified.split(".")[-1] == name
    ]
    if not named:
        raise ValueError(f"{type(model).__name__} has no submodule named {name!r} to tile; pass name=.")
    return _tile([(qualified, module, 1) for qualified, module in named if _is_dense(module)], tile_tokens)


def _is_dense(mlp: nn.Module) -> bool:
    """Not a mixture of experts: no submodule named ``experts`` and no grouped (3-D) expert weights. Experts
    are left whole: a router may record its logits per call (an auxiliary loss) or route by capacity."""
    names = {qualified.split(".")[-1] for qualified, _ in mlp.named_modules()}
    return "experts" not in names and all(p.dim() <= 2 for p in mlp.parameters())


def tile_experts(model: nn.Module, tile_tokens: int | None = None) -> list[str]:
    """Make every mixture of experts' routed experts and shared experts run over sequence tiles like
    :func:`tiled_mlp`; returns their qualified names.

    The routed experts are ``transformers``' ``experts`` modules (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next,
    Mixtral, gpt-oss, DeepSeek-V3, GLM-4-MoE and the other families of that interface):
    ``experts(hidden [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]`` computes every token from
    its own routing alone, so tiles of the tokens give the same output and gradients, the routing weights'
    (which reach the router) included. Tiled, the layer saves those three inputs instead of every routed
    token's ``top_k`` expert activations, and recomputes one tile's in the backward. The router is not
    tiled: it runs once on every token, so its logits (which transformers records for the load-balancing
    loss), its top-k and that loss are the untiled layer's. The shared experts (``shared_expert`` /
    ``shared_experts``: dense MLPs beside the routed ones) are tiled as MLPs. Call it once, before training.

    Raises:
        ValueError: ``model`` has no ``experts`` module, or one whose forward does not take
            ``(hidden_states, top_k_index, top_k_weights)`` (Llama-4's experts, a list of expert modules):
            the tiling does not know how its tokens are routed.
    """
    routed, unknown = [], []
    for qualified, module in model.named_modules():
        if qualified.split(".")[-1] == "experts":
            known = len(inspect.signature(_original_forward(module)).parameters) == 3
            (routed if known else unknown).append((qualified, module))
    if unknown:
        names = ", ".join(f"{q} ({type(m).__name__})" for q, m in unknown)
        raise ValueError(
            f"tile_experts cannot tile {names}: its forward does not take (hidden_states, top_k_index, "
            "top_k_weights), so the tiling does not know how its tokens are routed; leave this model's "
            "experts untiled (tiled=False)."
        )
    if not routed:
        raise ValueError(f"{type(model).__name__} has no mixture of experts (no 'experts' module) to tile.")
    shared = [
        (qualified, module)
        for qualified, module in model.named_modules()
        if qualified.split(".")[-1] in ("shared_expert", "shared_experts") and _is_dense(module)
    ]
    return _tile([(q, m, 3) for q, m in routed] + [(q, m, 1) for q, m in shared], tile_tokens)


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` has a mixture of experts: a submodule named ``experts`` (:func:`tile_experts`)."""
    return any(qualified.split(".")[-1] == "experts" for qualified, _ in model.named_modules())


def tile_norms(model: nn.Module, tile_tokens: int | None = None) -> list[str]:
    """Make every RMSNorm and LayerNorm of ``model`` that takes one tensor run over sequence tiles like
    :func:`tiled_mlp`; returns their qualified names.

    A norm's own backward keeps an fp32 copy of its input and the normalized input (``transformers``'
    RMSNorms), or what ``torch``'s kernels keep; tiled, it keeps only its input, which under a bf16 residual
    stream is a bf16 tensor the layer holds anyway. The norms are ``nn.LayerNorm`` and ``nn.RMSNorm`` over
    the last dim and the modules whose class name ends in ``RMSNorm`` or ``LayerNorm`` (every
    ``transformers`` decoder's, the per-head ``q_norm`` / ``k_norm`` included) whose forward takes one
    tensor: gated norms (a second input) stay as they are. Every one normalizes each vector of the last dim
    alone, so the tiles give the same output and gradients. Call it once, before training.

    Raises:
        ValueError: when ``model`` has no such norm.
    """
    found = [(qualified, module, 1) for qualified, module in model.named_modules() if _is_token_norm(module)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no RMSNorm or LayerNorm of one input to tile.")
    return _tile(found, tile_tokens)


def _is_token_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        norm = len(module.normalized_shape) == 1
    else:
        norm = type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
    parameters = list(inspect.signature(_original_forward(module)).parameters.values())
    return norm and len(parameters) == 1 and parameters[0].kind is not inspect.Parameter.VAR_POSITIONAL


def _tile(found: list[tuple[str, nn.Module, int]], tile_tokens: int | None) -> list[str]:
    """Tile each ``(name, module, inputs)``: its forward over tiles of its ``inputs`` token-aligned tensors."""
    for _, module, inputs in found:
        if not getattr(module, "_lightning_cp_tiled", False):
            module.forward = _TiledForward(module.forward, tile_tokens, inputs)
            module._lightning_cp_tiled = True
    return [qualified for qualified, _, _ in found]


def _original_forward(module: nn.Module) -> Any:
    """``module``'s forward before tiling."""
    return module.forward.original if isinstance(module.forward, _TiledForward) else module.forward


class _TiledForward:
    """A module instance's forward, over tiles (they run the original forward) of its ``inputs`` tensors,
    each ``[..., T, *]`` with the same ``T`` (dim -2)."""

    def __init__(self, forward: Any, tile_tokens: int | None, inputs: int = 1) -> None:
        self.original = forward
        self.tile_tokens = tile_tokens
        self.signature = inspect.signature(forward)
        self.inputs = inputs

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        tensors = list(self.signature.bind(*args, **kwargs).arguments.values())
        if len(tensors) != self.inputs or not all(isinstance(t, Tensor) and t.dim() >= 2 for t in tensors):
            raise ValueError(
                f"a tiled module takes {self.inputs} [..., T, d] tensor(s); this module gets other arguments."
            )
        if len({t.shape[-2] for t in tensors}) > 1:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise ValueError(f"a tiled module's inputs must share their token dim -2; got {shapes}.")
        return _tiled(self.original, self.original.__self__, tensors, self.tile_tokens)


def _tiled(forward: Any, module: nn.Module, inputs: list[Tensor], tile_tokens: int | None) -> Tensor:
    """``forward(*inputs)`` tile by tile of the inputs' token dim -2; ``module`` holds its parameters."""
    first = inputs[0]
    if tile_tokens is None:
        tile_tokens = auto_tile_tokens(first.shape[-2], first.shape[-1])
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens} must be a positive number of tokens.")
    if not torch.is_grad_enabled():
        return _tile_outputs(forward, inputs, tile_tokens)
    params = [p for p in module.parameters() if p.requires_grad]
    return _Tiled.apply(forward, tile_tokens, len(inputs), *inputs, *params)


def _tile_outputs(forward: Any, inputs: list[Tensor], tile_tokens: int) -> Tensor:
    tiles = zip(*(t.split(tile_tokens, dim=-2) for t in inputs), strict=True)
    outputs = [forward(*tile) for tile in tiles]
    if not all(isinstance(out, Tensor) for out in outputs):
        raise ValueError(
            "a tiled module must return one tensor per token; this one returns "
            f"{type(outputs[0]).__name__} (a mixture of experts with router outputs cannot be tiled)."
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)


class _Tiled(torch.autograd.Function):
    """``forward(*inputs)`` (the first ``count`` tensors, each ``[..., T, *]``) tile by tile of ``T``; saves
    the inputs only and recomputes tiles in the backward, under the forward's autocast state. The remaining
    tensors are the module's parameters, whose gradients are summed over the tiles."""

    @staticmethod
    def forward(ctx: Any, forward: Any, tile_tokens: int, count: int, *tensors: Tensor) -> Tensor:
        inputs = list(tensors[:count])
        with torch.no_grad():
            out = _tile_outputs(forward, inputs, tile_tokens)
        ctx.save_for_backward(*inputs)
        ctx.forward, ctx.tile_tokens, ctx.params = forward, tile_tokens, tensors[count:]  # the module's own
        device = inputs[0].device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        inputs, params = ctx.saved_tensors, ctx.params
        device, dtype, enabled = ctx.autocast
        wanted = [ctx.needs_input_grad[3 + i] for i in range(len(inputs))]
        dinputs = [torch.zeros_like(x) if want else None for x, want in zip(inputs, wanted, strict=True)]
        dparams: list[Tensor | None] = [None] * len(params)
        for start in range(0, inputs[0].shape[-2], ctx.tile_tokens):
            rows = slice(start, start + ctx.tile_tokens)
            tiles = [x[..., rows, :].detach().requires_grad_(w) for x, w in zip(inputs, wanted, strict=True)]
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                out = ctx.forward(*tiles)
            differentiable = [t for t in tiles if t.requires_grad] + list(params)
            if not differentiable:
                break
            grads = torch.autograd.grad(out, differentiable, dout[..., rows, :], allow_unused=True)
            tile_grads = iter(grads[: len(differentiable) - len(params)])
            for grad_input in dinputs:
                grad = None if grad_input is None else next(tile_grads)
                if grad is not None:
                    grad_input[..., rows, :] = grad
            for i, g in enumerate(grads[len(differentiable) - len(params) :]):
                if g is not None:
                    g = _accumulation(g)
                    dparams[i] = g if dparams[i] is None else dparams[i].add_(g)
        dparams = [None if g is None else g.to(p.dtype) for g, p in zip(dparams, params, strict=True)]
        return (None, None, None, *dinputs, *dparams)


def _accumulation(grad: Tensor) -> Tensor:
    """A tile's parameter gradient in the dtype the tiles' sum is kept in: fp32, or the gradient's own when
    wider. Summed in bf16 (FSDP's gathered parameters), the rounding of every partial sum would add up over
    the tiles; in fp32 the sum is rounded once, when it is returned in the parameter's dtype."""
    return grad.to(torch.promote_types(grad.dtype, torch.float32))
