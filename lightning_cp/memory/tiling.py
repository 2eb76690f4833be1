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

A tiled norm's output is not saved either by the modules that read it when they are tiled or are
projections (:func:`tile_projections`): they save the norm's input, which the norm saves anyway, and
recompute the norm's output tile by tile in their backward (a projection nothing else: its gradients need its
input, not its output) (Megatron-core's ``recompute_modules=["layernorm"]`` spares the same tensor another way).

:func:`tile_model` makes a model's MLPs, experts, norms and projections run so (the plan's ``+tiled``).

No communication: the tiles are this rank's tokens. The parameters' gradients are returned by the
autograd function (once per step, not per tile), so DDP's gradient hooks fire as usual; the recomputation
runs under the autocast state of the forward.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_cp import products
from lightning_cp.adaptation import applied, replace_forward


def auto_tile_tokens(tokens: int, model_dim: int) -> int:
    """Tokens per tile: ``tokens`` in ``ceil(tokens / model_dim)`` tiles of equal size (the last one
    shorter), so that a tile has at most ``model_dim`` tokens and one tile's ``[tile, ffn]`` intermediate is
    no larger than the MLP's ``[ffn, model_dim]`` weight, whatever the sequence length (DeepSpeed ALST's
    TiledMLP splits a sequence into ``ceil(seqlen / hidden_size)`` shards, arXiv:2506.13996)."""
    tiles = max(1, math.ceil(tokens / max(1, model_dim)))
    return max(1, math.ceil(tokens / tiles))


def tile_model(model: nn.Module, tile_tokens: int | None = None) -> list[str]:
    """Tile what ``HFCausalLM(tiled=True)`` tiles (the plan's ``+tiled``): the dense MLPs (:func:`tile_mlps`),
    a mixture of experts' experts when ``model`` has one (:func:`tile_experts`), the norms
    (:func:`tile_norms`) and the projections reading them (:func:`tile_projections`); returns the qualified
    names of the tiled modules. Call it once, before training.

    Raises:
        ValueError: as the four functions raise (no ``mlp`` module, experts the tiling does not know, no
            norm).
    """
    tiled = tile_mlps(model, tile_tokens)
    if has_experts(model):
        tiled += tile_experts(model, tile_tokens)
    return tiled + tile_norms(model, tile_tokens) + tile_projections(model, tile_tokens)


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

    A tiled norm's output is not kept by the tiled modules that read it (:func:`tile_mlps`,
    :func:`tile_experts`) nor by the projections of :func:`tile_projections`: they save the norm's input and
    recompute the output tile by tile in their backward. So a layer keeps neither the first norm's output,
    which the attention's projections read, nor the second's, which the tiled MLP reads: two ``[T_local,
    d]`` tensors per layer fewer.

    Raises:
        ValueError: when ``model`` has no such norm.
    """
    found = [(qualified, module, 1) for qualified, module in model.named_modules() if _is_token_norm(module)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no RMSNorm or LayerNorm of one input to tile.")
    return _tile(found, tile_tokens, _TiledNormForward)


def tile_projections(model: nn.Module, tile_tokens: int | None = None) -> list[str]:
    """Make every ``nn.Linear`` of ``model`` that reads a tiled norm's output (:func:`tile_norms`) save the
    norm's input instead of that output; returns their qualified names.

    Such a projection (the attention's ``q_proj``, ``k_proj``, ``v_proj``, GPT's fused ``qkv``, a hybrid
    mixer's input projection) computes its output as before, in one piece; its backward recomputes the
    norm's output tile by tile (``tile_tokens`` as :func:`tiled_mlp`) and computes each tile's input gradient
    and weight gradient from it (two products a tile, the projection's own output not recomputed), summing the
    weight's gradient over the tiles in fp32. The norm saves its input anyway,
    so the layer keeps one ``[T_local, d]`` tensor fewer. A projection reading anything else (or a norm's
    output changed in place since) runs as before. Call it once, before training.
    """
    found = [
        (qualified, module, 1) for qualified, module in model.named_modules() if isinstance(module, nn.Linear)
    ]
    return _tile(found, tile_tokens, _ProjectionForward)


def _is_token_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        norm = len(module.normalized_shape) == 1
    else:
        norm = type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
    parameters = list(inspect.signature(_original_forward(module)).parameters.values())
    return norm and len(parameters) == 1 and parameters[0].kind is not inspect.Parameter.VAR_POSITIONAL


def _tile(
    found: list[tuple[str, nn.Module, int]],
    tile_tokens: int | None,
    wrapper: type[_TiledForward] | None = None,
) -> list[str]:
    """Tile each ``(name, module, inputs)``: its forward replaced by ``wrapper`` (:class:`_TiledForward`: over
    tiles of its ``inputs`` token-aligned tensors)."""
    for _, module, inputs in found:
        if "tiling" not in applied(module):
            tiled = (wrapper or _TiledForward)(module.forward, tile_tokens, inputs)
            replace_forward(module, "tiling", tiled, bind=False)
    return [qualified for qualified, _, _ in found]


def _original_forward(module: nn.Module) -> Any:
    """``module``'s forward before tiling."""
    return getattr(module.forward, "original", module.forward)


_NORM_OUTPUT = "_lightning_cp_norm_output"
"""The attribute of a tiled norm's output that says how to recompute it (a :class:`_NormOutput`)."""


@dataclass(frozen=True)
class _Norm:
    """A tiled norm's own forward and the autocast state of its call: what recomputes its output."""

    forward: Any
    autocast: tuple[str, torch.dtype, bool]

    def rows(self, source: Tensor, rows: slice) -> Tensor:
        """The norm's output at ``rows`` of the token dim -2, recomputed from ``source`` (its input)."""
        device, dtype, enabled = self.autocast
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            return self.forward(source[..., rows, :])


@dataclass(frozen=True)
class _NormOutput:
    """What a tiled norm's output carries (:data:`_NORM_OUTPUT`): the norm, its input, and the output's
    version counter when made (an in-place change since voids it)."""

    norm: _Norm
    input: Tensor
    version: int

    @staticmethod
    def of(x: Tensor) -> _NormOutput | None:
        """The recipe of ``x`` when ``x`` is a tiled norm's output, or a reshape of it that keeps its last
        dim and its memory (``view(-1, d)``, as a mixture of experts flattens its tokens), unchanged since
        the norm made it (the input then shaped as ``x``); else ``None``."""
        base = x if x._base is None else x._base
        recipe = getattr(base, _NORM_OUTPUT, None)
        if recipe is None or base._version != recipe.version:
            return None
        if x is base:
            return recipe
        reshaped = x.shape[-1] == base.shape[-1] and x.numel() == base.numel() and x.is_contiguous()
        contiguous = base.is_contiguous() and recipe.input.is_contiguous()
        if not (reshaped and contiguous and x.data_ptr() == base.data_ptr()):
            return None
        return _NormOutput(recipe.norm, recipe.input.view(x.shape), recipe.version)


class _TiledForward:
    """A module instance's forward, over tiles (they run the original forward) of its ``inputs`` tensors,
    each ``[..., T, *]`` with the same ``T`` (dim -2)."""

    def __init__(self, forward: Any, tile_tokens: int | None, inputs: int = 1) -> None:
        self.original = forward
        self.tile_tokens = tile_tokens
        self.signature = inspect.signature(forward)
        self.inputs = inputs

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return _tiled(self.original, self.original.__self__, self._tensors(args, kwargs), self.tile_tokens)

    def _tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
        """The call's ``inputs`` token-aligned tensors, checked."""
        tensors = list(self.signature.bind(*args, **kwargs).arguments.values())
        if len(tensors) != self.inputs or not all(isinstance(t, Tensor) and t.dim() >= 2 for t in tensors):
            raise ValueError(
                f"a tiled module takes {self.inputs} [..., T, d] tensor(s); this module gets other arguments."
            )
        if len({t.shape[-2] for t in tensors}) > 1:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise ValueError(f"a tiled module's inputs must share their token dim -2; got {shapes}.")
        return tensors


class _TiledNormForward(_TiledForward):
    """A norm's forward over tiles; its output carries the recipe (:class:`_NormOutput`) its readers recompute
    it from."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        (x,) = self._tensors(args, kwargs)
        out = _tiled(self.original, self.original.__self__, [x], self.tile_tokens)
        if out.requires_grad:
            recipe = _NormOutput(_Norm(self.original, _autocast_state(x)), x, out._version)
            setattr(out, _NORM_OUTPUT, recipe)
        return out


class _ProjectionForward(_TiledForward):
    """An ``nn.Linear`` instance's forward: as before, but when its input is a tiled norm's output, through
    :class:`_Tiled` (in one piece forward, over tiles backward) so that the norm's input is saved instead."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        arguments = list(self.signature.bind(*args, **kwargs).arguments.values())
        x = arguments[0] if len(arguments) == 1 else None  # a subclass's forward may take more
        reads_norm = isinstance(x, Tensor) and x.dim() >= 2 and _NormOutput.of(x) is not None
        if not (torch.is_grad_enabled() and reads_norm):
            return self.original(*args, **kwargs)
        return _tiled(self.original, self.original.__self__, [x], self.tile_tokens, tile_forward=False)


def _autocast_state(x: Tensor) -> tuple[str, torch.dtype, bool]:
    device = x.device.type
    return device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)


def _tiled(
    forward: Any,
    module: nn.Module,
    inputs: list[Tensor],
    tile_tokens: int | None,
    *,
    tile_forward: bool = True,
) -> Tensor:
    """``forward(*inputs)`` tile by tile of the inputs' token dim -2 (``tile_forward=False``: in one piece,
    the backward still by tiles); ``module`` holds its parameters."""
    first = inputs[0]
    if tile_tokens is None:
        tile_tokens = auto_tile_tokens(first.shape[-2], first.shape[-1])
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens} must be a positive number of tokens.")
    if not torch.is_grad_enabled():
        return _tile_outputs(forward, inputs, tile_tokens)
    params = [p for p in module.parameters() if p.requires_grad]
    return _Tiled.apply(
        forward, module, tile_tokens if tile_forward else None, tile_tokens, len(inputs), *inputs, *params
    )


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
    """``forward(*inputs)`` (the first ``count`` tensors, each ``[..., T, *]``) tile by tile of ``T``
    (``forward_tile`` tokens; ``None``: in one piece); saves the inputs only (of an input that is a tiled
    norm's output, the norm's input) and recomputes tiles of ``tile_tokens`` in the backward, under the
    forward's autocast state. The remaining tensors are ``module``'s parameters, whose gradients are summed
    over the tiles in fp32 (:func:`_add_tile_gradient`)."""

    @staticmethod
    def forward(
        ctx: Any,
        forward: Any,
        module: nn.Module,
        forward_tile: int | None,
        tile_tokens: int,
        count: int,
        *tensors: Tensor,
    ) -> Tensor:
        inputs = list(tensors[:count])
        with torch.no_grad():
            out = forward(*inputs) if forward_tile is None else _tile_outputs(forward, inputs, forward_tile)
        outputs = [_NormOutput.of(x) for x in inputs]
        ctx.save_for_backward(*(x if n is None else n.input for x, n in zip(inputs, outputs, strict=True)))
        ctx.norms = [None if n is None else n.norm for n in outputs]  # no tensor kept beside the saved ones
        ctx.dtypes = [x.dtype for x in inputs]  # a norm's output may differ from its input's
        ctx.forward, ctx.module, ctx.tile_tokens = forward, module, tile_tokens
        ctx.params = tensors[count:]  # the module's own
        ctx.autocast = _autocast_state(inputs[0])
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if _is_linear_call(ctx.forward, ctx.module) and len(ctx.norms) == 1:
            return (None, None, None, None, None, *_linear_gradients(ctx, dout))
        inputs, params = ctx.saved_tensors, ctx.params
        device, dtype, enabled = ctx.autocast
        skipped = 5  # forward, module, forward_tile, tile_tokens, count
        wanted = [ctx.needs_input_grad[skipped + i] for i in range(len(inputs))]
        dinputs = [
            torch.zeros_like(x, dtype=read) if want else None
            for x, read, want in zip(inputs, ctx.dtypes, wanted, strict=True)
        ]
        dparams: list[Tensor | None] = [None] * len(params)
        cast = _cast_linear_weights(ctx.module, params, ctx.autocast)
        with torch.enable_grad(), cast as targets:
            for start in range(0, inputs[0].shape[-2], ctx.tile_tokens):
                rows = slice(start, start + ctx.tile_tokens)
                tiles = [
                    (x[..., rows, :] if norm is None else norm.rows(x, rows)).detach().requires_grad_(w)
                    for x, norm, w in zip(inputs, ctx.norms, wanted, strict=True)
                ]
                with torch.autocast(device, dtype=dtype, enabled=enabled):  # the backward without, as usual
                    out = ctx.forward(*tiles)
                differentiable = [t for t in tiles if t.requires_grad]
                if not differentiable and not params:
                    break
                grads = torch.autograd.grad(
                    out, differentiable + [t for _, t in targets], dout[..., rows, :], allow_unused=True
                )
                tile_grads = iter(grads[: len(differentiable)])
                for grad_input in dinputs:
                    grad = None if grad_input is None else next(tile_grads)
                    if grad is not None:
                        grad_input[..., rows, :] = grad
                for (i, _), grad in zip(targets, grads[len(differentiable) :], strict=True):
                    dparams[i] = _add_tile_gradient(dparams[i], grad)
        dparams = [None if g is None else g.to(p.dtype) for g, p in zip(dparams, params, strict=True)]
        return (None, None, None, None, None, *dinputs, *dparams)


def _is_linear_call(forward: Any, module: nn.Module) -> bool:
    """Whether ``forward`` is ``nn.Linear.forward`` of ``module``: ``F.linear`` of its weight and bias."""
    return (
        getattr(forward, "__func__", None) is nn.Linear.forward
        and getattr(forward, "__self__", None) is module
    )


def _linear_gradients(ctx: Any, dout: Tensor) -> list[Tensor | None]:
    """The gradients of an ``nn.Linear``'s input and parameters, tile by tile, without its output: ``dx = dout
    W``, ``dW = sum dout^T x``, ``db = sum dout``, in the dtype ``F.linear`` ran in (``dout``'s: autocast's under
    autocast). The input's tile is a tiled norm's output recomputed, or a tile of the saved input; the
    parameters' sums are fp32 (one GEMM into fp32 a tile on CUDA: :func:`~lightning_cp.products.add_product`).
    A projection has nothing of its output to recompute: only its input, which the norm rebuilds."""
    (x,), (norm,), (read,) = ctx.saved_tensors, ctx.norms, ctx.dtypes
    linear, compute = ctx.module, dout.dtype
    weight = linear.weight.detach().to(compute)
    dx = torch.empty_like(x, dtype=read) if ctx.needs_input_grad[5] else None
    sums = {id(p): torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in ctx.params}
    weight_sum, bias_sum = sums.get(id(linear.weight)), sums.get(id(linear.bias))
    for start in range(0, x.shape[-2], ctx.tile_tokens):
        rows = slice(start, start + ctx.tile_tokens)
        grad = dout[..., rows, :]
        if dx is not None:
            dx[..., rows, :] = grad @ weight
        grad = grad.reshape(-1, grad.shape[-1])
        if weight_sum is not None:
            tile = (x[..., rows, :] if norm is None else norm.rows(x, rows)).to(compute)
            products.add_product(weight_sum, grad.t(), tile.reshape(-1, tile.shape[-1]))
        if bias_sum is not None:
            bias_sum += grad.sum(0, dtype=bias_sum.dtype)
    return [dx, *(sums[id(p)].to(p.dtype) for p in ctx.params)]


def _add_tile_gradient(total: Tensor | None, grad: Tensor | None) -> Tensor | None:
    """``total`` plus one tile's parameter gradient, kept in fp32 (or the gradient's own dtype when wider).

    Summed in bf16 (FSDP's gathered parameters, or the autocast copies of :func:`_cast_linear_weights`), the
    rounding of every partial sum would add up over the tiles; in fp32 the sum is rounded once, when it is
    returned in the parameter's dtype. A narrower gradient is widened inside the in-place add: per tile and
    parameter, one read of the tile's gradient and one read-modify-write of the sum, and no fp32 copy of
    the tile's gradient (which read and wrote every parameter once more per tile)."""
    if grad is None:
        return total
    if total is None:
        return grad.to(torch.promote_types(grad.dtype, torch.float32))
    return total.add_(grad)


@contextmanager
def _cast_linear_weights(
    module: nn.Module, params: tuple[Tensor, ...], autocast: tuple[str, torch.dtype, bool]
) -> Iterator[list[tuple[int, Tensor]]]:
    """Yield what the tiles' recomputation differentiates, as ``(index in params, tensor)`` pairs: each
    parameter, but under autocast to a narrower dtype an ``nn.Linear``'s fp32 weight stands in for the
    recomputation as one leaf copy in the autocast dtype, cast once for all the tiles.

    Autocast would cast that weight again in every tile's forward and widen every tile's weight gradient back
    to fp32 (a read and a write of the whole weight each, per tile); the copy takes the same values as
    autocast's cast, and its narrow gradients are summed in fp32 by :func:`_add_tile_gradient`, so the sum is
    what the widened gradients gave. A call of the ``nn.Linear`` with autocast off (a module that forces fp32)
    gets the fp32 weight back for that call, which is then differentiated too (a second pair); an
    ``nn.Linear`` whose forward is not ``nn.Linear.forward`` (which may turn autocast off inside) keeps its
    weight. The module's own parameters are back in place on exit."""
    device, dtype, enabled = autocast
    targets = list(enumerate(params))
    if not enabled or dtype == torch.float32:
        yield targets
        return
    index = {id(p): i for i, p in enumerate(params)}
    swaps: list[tuple[nn.Linear, Tensor, Tensor]] = []
    for linear in module.modules():
        weight = linear.weight if _runs_linear_as_is(linear) else None
        if weight is None or id(weight) not in index:
            continue
        if weight.dtype != torch.float32 or weight.device.type != device:
            continue
        copy = weight.detach().to(dtype).requires_grad_()
        targets[index[id(weight)]] = (index[id(weight)], copy)
        targets.append((index[id(weight)], weight))
        swaps.append((linear, weight, copy))

    def pick(linear: nn.Module, *_: Any) -> None:  # as torch.func.functional_call swaps a parameter
        weight, copy = weights[linear]
        autocast_on = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == dtype
        linear._parameters["weight"] = copy if autocast_on else weight

    weights = {linear: (weight, copy) for linear, weight, copy in swaps}
    handles = [linear.register_forward_pre_hook(pick) for linear, _, _ in swaps]
    try:
        yield targets
    finally:
        for handle in handles:
            handle.remove()
        for linear, weight, _ in swaps:
            linear._parameters["weight"] = weight


def _runs_linear_as_is(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` whose call is ``F.linear`` of its weight, autocast as it finds
    it (its forward neither overridden by a subclass nor replaced on the instance)."""
    return (
        isinstance(module, nn.Linear)
        and type(module).forward is nn.Linear.forward
        and "forward" not in vars(module)
    )
