"""A token-wise MLP computed over tiles of the sequence, so its ``[T, ffn]`` intermediates never exist whole.

An MLP (GPT's ``Linear -> GELU -> Linear``, a SwiGLU ``down(act(gate(x)) * up(x))``) acts on every token
alone, so running it on tiles of the tokens gives the same output. :func:`tiled_mlp` runs the tiles one
after another without building a graph and saves only its input; the backward recomputes each tile's
forward and back-propagates through it, summing the parameters' gradients over the tiles. One tile's
intermediates are alive at a time (forward and backward), instead of the whole ``[T_local, ffn]`` ones
autograd would keep. The price is one extra forward of the MLP in the backward (as with activation
checkpointing, which recomputes the MLP anyway; tiled inside a checkpointed layer, it runs twice).

No communication: the tiles are this rank's tokens. The parameters' gradients are returned by the
autograd function (once per step, not per tile), so DDP's gradient hooks fire as usual.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn


def auto_tile_tokens(tokens: int, model_dim: int, hidden_dim: int) -> int:
    """Tokens per tile so that one tile's ``[tile, hidden_dim]`` intermediate is no larger than the MLP's
    ``[tokens, model_dim]`` input: ``ceil(tokens / ceil(hidden_dim / model_dim))``, at least 1."""
    return max(1, math.ceil(tokens / max(1, math.ceil(hidden_dim / model_dim))))


def tiled_mlp(mlp: nn.Module, x: Tensor, tile_tokens: int | None = None) -> Tensor:
    """``mlp(x)`` computed over tiles of ``x``'s second-to-last (token) dim, with the same result.

    Args:
        mlp: a module that maps every token alone (``[..., T, d] -> [..., T, d_out]``) to one tensor.
        x: ``[..., T, d]`` (``[B, S, d]`` or ``[T, d]``).
        tile_tokens: tokens per tile; ``None``: :func:`auto_tile_tokens` from ``mlp``'s widest
            ``nn.Linear`` output.

    Returns:
        ``mlp(x)``, differentiable in ``x`` and in ``mlp``'s parameters.
    """
    return _tiled(mlp, mlp, x, tile_tokens)


def tile_mlps(model: nn.Module, tile_tokens: int | None = None, *, name: str = "mlp") -> list[str]:
    """Make every submodule named ``name`` (GPT's and ``transformers``' decoder layers call theirs ``mlp``)
    run through :func:`tiled_mlp`; returns their qualified names.

    The modules stay where they are (the forward of each instance is replaced), so parameter names,
    checkpoints and FSDP units are unchanged. Call it once, before training (``configure_model``).

    Raises:
        ValueError: when ``model`` has no such submodule.
    """
    found = [
        (qualified, module) for qualified, module in model.named_modules() if qualified.split(".")[-1] == name
    ]
    if not found:
        raise ValueError(f"{type(model).__name__} has no submodule named {name!r} to tile; pass name=.")
    for _, module in found:
        if not getattr(module, "_lightning_cp_tiled", False):
            module.forward = _TiledForward(module.forward, tile_tokens)
            module._lightning_cp_tiled = True
    return [qualified for qualified, _ in found]


class _TiledForward:
    """An MLP instance's forward, through :func:`tiled_mlp` (its tiles run the original forward)."""

    def __init__(self, forward: Any, tile_tokens: int | None) -> None:
        self.original = forward
        self.tile_tokens = tile_tokens

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if args or kwargs or x.dim() < 2:
            raise ValueError("a tiled MLP takes one [..., T, d] tensor; this module gets other arguments.")
        return _tiled(self.original, self.original.__self__, x, self.tile_tokens)


def _tiled(forward: Any, module: nn.Module, x: Tensor, tile_tokens: int | None) -> Tensor:
    """``forward(x)`` tile by tile; ``module`` holds its parameters."""
    tokens = x.shape[-2]
    if tile_tokens is None:
        tile_tokens = auto_tile_tokens(tokens, x.shape[-1], _hidden_dim(module, x.shape[-1]))
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens} must be a positive number of tokens.")
    if tile_tokens >= tokens or not torch.is_grad_enabled():
        return _tile_outputs(forward, x, tile_tokens)
    params = [p for p in module.parameters() if p.requires_grad]
    return _TiledMLP.apply(x, forward, tile_tokens, *params)


def _hidden_dim(mlp: nn.Module, model_dim: int) -> int:
    widths = [m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)]
    return max(widths, default=model_dim)


def _tile_outputs(forward: Any, x: Tensor, tile_tokens: int) -> Tensor:
    outputs = [forward(tile) for tile in x.split(tile_tokens, dim=-2)]
    if not all(isinstance(out, Tensor) for out in outputs):
        raise ValueError(
            "a tiled MLP must return one tensor per token; this one returns "
            f"{type(outputs[0]).__name__} (a mixture of experts with router outputs cannot be tiled)."
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)


class _TiledMLP(torch.autograd.Function):
    """``x [..., T, d]`` -> ``mlp(x)``, tile by tile; saves ``x`` only and recomputes tiles in the backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, forward: Any, tile_tokens: int, *params: Tensor) -> Tensor:
        with torch.no_grad():
            out = _tile_outputs(forward, x, tile_tokens)
        ctx.save_for_backward(x)
        ctx.forward, ctx.tile_tokens, ctx.params = forward, tile_tokens, params  # the module's own
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        params = ctx.params
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dparams: list[Tensor | None] = [None] * len(params)
        for start in range(0, x.shape[-2], ctx.tile_tokens):
            rows = slice(start, start + ctx.tile_tokens)
            tile = x[..., rows, :].detach().requires_grad_(dx is not None)
            with torch.enable_grad():
                out = ctx.forward(tile)
            inputs = [tile, *params] if dx is not None else params
            grads = torch.autograd.grad(out, inputs, dout[..., rows, :], allow_unused=True)
            if dx is not None:
                dx[..., rows, :] = grads[0]
                grads = grads[1:]
            for i, g in enumerate(grads):
                if g is not None:
                    dparams[i] = g if dparams[i] is None else dparams[i] + g
        return (dx, None, None, *dparams)
