"""The counter behind ``efficiency.py``: one CP rank's layer and fused loss run on fake tensors, every
operator it dispatches counted (:class:`DispatchCounter`), the bytes its exchange sends counted too.

See ``efficiency.py`` for what is counted and why; this module runs the counts.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any

import torch
from _fla_stand_in import LAUNCHES, chunk_gated_delta_rule
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import conv_flop_count, flop_registry

import lightning_cp.parallel._sparse_triton  # noqa: F401  (registers the top-k attention's operators)

_ATEN = torch.ops.aten
_METADATA = {
    torch.ops.prim.device,
    _ATEN.size,
    _ATEN.sym_size,
    _ATEN.stride,
    _ATEN.sym_stride,
    _ATEN.numel,
    _ATEN.sym_numel,
    _ATEN.dim,
    _ATEN.is_contiguous,
    _ATEN.storage_offset,
    _ATEN.sym_storage_offset,
    torch.ops.prim.layout,
}
"""Queries of a tensor's metadata: no kernel runs."""
_SDPA = {
    _ATEN._scaled_dot_product_flash_attention_for_cpu: (0, 2, 1),
    _ATEN._scaled_dot_product_flash_attention_for_cpu_backward: (1, 3, 2),
    _ATEN._scaled_dot_product_flash_attention: (0, 2, 1),
    _ATEN._scaled_dot_product_flash_attention_backward: (1, 3, 2),
}
"""The fused SDPA kernels of a sequence held whole (``local_attention``, always causal): the positions of
``q`` ``[B, H, S, D]`` and ``v`` in their arguments, and their matmuls over the forward's."""


@dataclass
class Counts:
    """What one rank dispatched: operators, matmul FLOPs by input dtype, bytes sent by collective."""

    ops: int = 0
    flops: Counter[str] = field(default_factory=Counter)
    """Matmul FLOPs by the dtype of the inputs (``"torch.bfloat16"``, ``"torch.float32"``)."""
    attention_flops: int = 0
    """Of :attr:`flops`, those of FlashAttention's calls."""
    forward_flops: int = 0
    """Of :attr:`flops`, those dispatched before the backward."""
    sent: Counter[str] = field(default_factory=Counter)
    """Bytes this rank sends, by collective (``all_gather``, ``reduce_scatter``, ``all_to_all``)."""
    ops_in: Counter[str] = field(default_factory=Counter)
    """:attr:`ops` by region (:data:`REGIONS`; ``"layer"``: the rest)."""
    flops_in: Counter[str] = field(default_factory=Counter)
    """:attr:`flops` (every dtype) by region, as :attr:`ops_in`."""
    fp32_in: Counter[str] = field(default_factory=Counter)
    """Of :attr:`flops_in`, those whose inputs are fp32."""

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def fp32_share(self) -> float:
        """The share of the matmul FLOPs whose inputs are fp32."""
        return self.flops["torch.float32"] / max(1, self.total_flops)


REGIONS = {"indexer": ("lightning_cp.parallel.key_indexer", ("select_topk_keys",))}
"""Functions whose operators and FLOPs :class:`Counts` also counts apart: a DSA layer's indexer selection, whose
loop runs over query blocks (one ``indexer_scores`` call and one top-k each; ``benchmarks/_dsa_fit.py`` fits it
by its blocks)."""
OP_REGIONS = {
    torch.ops.lightning_cp.sparse_forward_round: "attention",
    torch.ops.lightning_cp.sparse_backward_round: "attention",
    **dict.fromkeys(LAUNCHES, "delta_rule"),
}
"""Operators counted apart wherever they run: the top-k attention's kernels, one a round, and ``fla``'s chunked
delta rule (:func:`gpu_paths`)."""


class DispatchCounter(TorchDispatchMode):
    """Counts the operators dispatched on fake (device) tensors into :class:`Counts`; runs the ones on real
    (host) tensors for real, uncounted. Enter it inside the ``FakeTensorMode`` the model was built in."""

    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts
        self.paused = False
        self.backward = False
        self.region = "layer"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():  # the shard's index arithmetic: real, on the host
                return func(*args, **kwargs)
        if func is _ATEN._flash_attention_forward.default:
            q, _, v, cu_q, cu_k = args[:5]
            out = (torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))
            out += (q.new_empty(2, dtype=torch.uint64), q.new_empty((), dtype=torch.uint64), q.new_empty(0))
            self._attention(q, v, cu_q, cu_k, 1)
        elif func is _ATEN._flash_attention_backward.default:
            _, q, k, v, _, _, cu_q, cu_k = args[:8]
            out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
            self._attention(q, v, cu_q, cu_k, 2)  # torch's formula: twice the forward's matmuls
        else:
            out = func(*args, **kwargs)
            if func.overloadpacket in _SDPA:
                q_at, v_at, matmuls = _SDPA[func.overloadpacket]
                q, v = args[q_at], args[v_at]
                rows, _, length, _ = q.shape
                self._add_attention(q.dtype, rows * length * (length + 1) // 2, q.shape[1], q, v, matmuls)
            else:
                self._matmul(func, args, kwargs, out, tensors)
        if not self.paused and func.overloadpacket not in _METADATA:
            launches = LAUNCHES.get(func.overloadpacket, 1)  # an operator standing for several kernels: each
            self.counts.ops += launches
            self.counts.ops_in[OP_REGIONS.get(func.overloadpacket, self.region)] += launches
        return out

    def _add(self, dtype: torch.dtype, flops: int, region: str | None = None) -> None:
        if self.paused:
            return
        region = region or self.region
        self.counts.flops[str(dtype)] += flops
        self.counts.flops_in[region] += flops
        if dtype == torch.float32:
            self.counts.fp32_in[region] += flops
        if not self.backward:
            self.counts.forward_flops += flops

    def _matmul(self, func: Any, args: tuple, kwargs: dict, out: Any, tensors: list[Tensor]) -> None:
        packet = func.overloadpacket
        # An in-place matmul (addmm_, baddbmm_) costs its out-of-place twin's FLOPs (no formula of its own).
        packet = (
            getattr(_ATEN, packet.__name__.rstrip("_"), packet) if packet.__name__.endswith("_") else packet
        )
        if packet is _ATEN._grouped_mm:
            a, b = args[:2]
            # 2-D x 2-D (a weight's gradient): groups split the reduced dim; otherwise the rows.
            reduced = a.shape[1] if a.dim() == 2 and b.dim() == 2 else a.shape[-1]
            flops = 2 * reduced * (out[0].numel() if a.dim() == 2 and b.dim() == 2 else out.numel())
        elif packet is _ATEN.convolution_backward:
            # The input's and the weight's gradients, each the forward's products. torch's formula counts the
            # weight's over every pair of channels, ignoring the groups: a depthwise convolution's (the hybrid
            # mixers') backward as a dense convolution's, C times its FLOPs.
            grad_out, x, weight, transposed, mask = args[0], args[1], args[2], args[7], args[10]
            forward = conv_flop_count(list(x.shape), list(weight.shape), list(grad_out.shape), transposed)
            flops = forward * (mask[0] + mask[1])
        elif packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            return
        if flops:
            self._add(next(t.dtype for t in tensors if t.is_floating_point()), flops, OP_REGIONS.get(packet))

    def _attention(self, q: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, matmuls: int) -> None:
        with unset_fake_temporarily():
            pieces = zip(cu_q.diff().tolist(), cu_k.diff().tolist(), strict=True)
        pairs = sum(lq * (lk - lq) + lq * (lq + 1) // 2 for lq, lk in pieces)  # bottom-right causal
        self._add_attention(q.dtype, pairs, q.shape[1], q, v, matmuls)

    def _add_attention(
        self, dtype: torch.dtype, pairs: int, heads: int, q: Tensor, v: Tensor, matmuls: int
    ) -> None:
        flops = matmuls * 2 * pairs * heads * (q.shape[-1] + v.shape[-1])
        self._add(dtype, flops)
        if not self.paused:
            self.counts.attention_flops += flops

    @contextlib.contextmanager
    def regions(self) -> Iterator[None]:
        """The functions of :data:`REGIONS` counted apart while inside."""
        import importlib

        def region(name: str, function: Callable) -> Callable:
            def call(*args: Any, **kwargs: Any) -> Any:
                outer, self.region = self.region, name
                try:
                    return function(*args, **kwargs)
                finally:
                    self.region = outer

            return call

        wraps = {
            getattr(importlib.import_module(module), function): (lambda f, n=name: region(n, f))
            for name, (module, functions) in REGIONS.items()
            for function in functions
        }
        with _replaced(wraps):
            yield

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Nothing counted inside (the simulated peers' stand-ins)."""
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused


def _count_exchange(exchange: Any, counter: DispatchCounter) -> None:
    """``exchange``'s collectives count their bytes (ring volumes) and one operator each, not the
    simulation's stand-ins."""
    size = exchange.size

    def counted(name: str, method: Callable[[Tensor], Tensor], nbytes: Callable[[Tensor], int]) -> Callable:
        def call(x: Tensor) -> Tensor:
            with counter.pause():
                out = method(x)
            counter.counts.sent[name] += nbytes(x)
            counter.counts.ops += 1
            counter.counts.ops_in[counter.region] += 1
            return out

        return call

    sizes = {
        "all_gather": lambda x: (size - 1) * x.nbytes,
        "reduce_scatter": lambda x: (size - 1) * x.nbytes // size,
        "all_to_all": lambda x: (size - 1) * x.nbytes // size,
    }
    for name, nbytes in sizes.items():
        setattr(exchange, name, counted(name, getattr(exchange, name), nbytes))


@contextlib.contextmanager
def gpu_paths() -> Iterator[None]:
    """CP attention through FlashAttention's calls, the top-k attention through its Triton kernels' custom ops
    (one operator a round; the indexer's scores are one already), the products summed into fp32 (the loss's
    weight gradient, MLA's latent backward) as one bf16 GEMM with an fp32 output, and a Gated DeltaNet's chunked
    delta rule through ``fla``'s kernels (:mod:`_fla_stand_in`), as on a GPU."""
    from lightning_cp import products
    from lightning_cp.hf.mixers import delta_rule
    from lightning_cp.parallel import _sparse_triton, _varlen, sparse_attention

    def add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:  # torch.mm(a, b, out_dtype=fp32)
        if a.dtype != b.dtype:  # as products.add_product: mixed dtypes in the accumulator's
            a, b = a.to(acc.dtype), b.to(acc.dtype)
        acc.add_(torch.mm(a, b).to(acc.dtype))

    modeling_kernels = delta_rule.kernels
    saved = _varlen.use_flash, products.add_product, sparse_attention._kernels, delta_rule.kernels
    _varlen.use_flash = lambda q, k, v, softcap: (
        softcap is None and q.dtype in (torch.bfloat16, torch.float16)
    )
    products.add_product = add_product
    sparse_attention._kernels = lambda q: (_sparse_triton.forward_round, _sparse_triton.backward_round)
    delta_rule.kernels = lambda module: _Overlay(
        modeling_kernels(module), torch_chunk_gated_delta_rule=chunk_gated_delta_rule
    )
    try:
        with _host_head_indices():
            yield
    finally:
        _varlen.use_flash, products.add_product, sparse_attention._kernels, delta_rule.kernels = saved


class _Overlay:
    """A modeling module's kernels with some replaced by name (what ``transformers`` would resolve on a GPU)."""

    def __init__(self, module: Any, **replaced: Callable) -> None:
        self._module, self._replaced = module, replaced

    def __getattr__(self, name: str) -> Any:
        return self._replaced[name] if name in self._replaced else getattr(self._module, name)


@contextlib.contextmanager
def _host_head_indices() -> Iterator[None]:
    """The heads each rank takes (``head_slices``, ``shared_heads``: small int64 tensors on the CPU, made per
    call) computed as real tensors: inside ``FakeTensorMode`` their ``torch.arange`` would be fake, and
    ``unique_consecutive`` of a fake tensor has no shape (``DynamicOutputShapeException``)."""
    import lightning_cp.hf.mixers  # noqa: F401  (every module that imports them, loaded)
    from lightning_cp.parallel import _ulysses_attention, head_parallel  # noqa: F401

    def real(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def call(*args: Any) -> Tensor:
            with unset_fake_temporarily():
                return function(*args)

        return call

    with _replaced({getattr(head_parallel, name): real for name in ("head_slices", "shared_heads")}):
        yield


@contextlib.contextmanager
def _replaced(wraps: dict[Callable, Callable[[Callable], Callable]]) -> Iterator[None]:
    """Every ``lightning_cp`` module's name for a function of ``wraps`` bound to its wrapped function inside
    (the modules that imported it by name included)."""
    import sys

    patched = [
        (module, name, value)
        for module in list(sys.modules.values())
        if getattr(module, "__name__", "").startswith("lightning_cp.")
        for name, value in list(vars(module).items())
        if isinstance(value, FunctionType) and value in wraps
    ]
    for module, name, value in patched:
        setattr(module, name, wraps[value](value))
    try:
        yield
    finally:
        for module, name, value in patched:
            setattr(module, name, value)


def _build(config: dict[str, Any], style: str, cp: int, tiled: bool) -> nn.Module:
    import transformers

    from lightning_cp.hf.indexers import adapt_indexers
    from lightning_cp.hf.latent import adapt_latent_attention
    from lightning_cp.hf.mixers import adapt_token_mixers
    from lightning_cp.memory import tile_model

    transformers.logging.set_verbosity_error()
    dtype = torch.bfloat16 if style == "fsdp" else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config), attn_implementation="lightning_cp", dtype=dtype
    )
    model.train()
    adapt_token_mixers(model, cp)
    adapt_indexers(model)
    adapt_latent_attention(model)
    if tiled:
        tile_model(model)
    return model


def _autocast(style: str) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=style == "ddp")


def count_layer(
    config: dict[str, Any],
    index: int,
    *,
    cp: int,
    tokens: int,
    style: str = "fsdp",
    checkpointing: bool = False,
    tiled: bool = False,
    attention: Any = None,
) -> Counts:
    """Forward + backward of decoder layer ``index`` of a model of ``config`` on rank 0 of a CP group of
    ``cp`` holding ``tokens`` local tokens (one sequence of ``cp * tokens``), counted on fake tensors.

    Args:
        style: ``"fsdp"``: bf16 parameters; ``"ddp"``: fp32 parameters under ``torch.autocast(bf16)``.
        checkpointing: the layer under ``torch.utils.checkpoint`` (non-reentrant, as the strategies wrap it).
        tiled: :func:`~lightning_cp.memory.tile_model` applied.
        attention: the shard's :class:`~lightning_cp.parallel.attention_mode.AttentionMode` (default:
            all-gather, every head at once).
    """
    from lightning_cp.hf.masks import DeferredMask
    from lightning_cp.parallel import shard_batch
    from lightning_cp.parallel.simulated import SimulatedCPGroup

    group = SimulatedCPGroup(cp, sum_key_gradients=False)
    exchange = group.exchange(0)
    batch = shard_batch(
        {"input_ids": torch.zeros(1, cp * tokens, dtype=torch.long)},
        cp,
        0,
        cp_group=exchange,
        attention=attention,
    )
    shard, positions = batch["cp_shard"], batch["cp_shard"].position_ids
    counts = Counts()
    with FakeTensorMode(allow_non_fake_inputs=True), gpu_paths():
        model = _build(config, style, cp, tiled)
        decoder = model.model
        layer = decoder.layers[index]
        x = torch.empty(1, tokens, config["hidden_size"], dtype=next(layer.parameters()).dtype)
        x.requires_grad_()
        with _autocast(style):
            rope = decoder.rotary_emb(x, positions) if hasattr(decoder, "rotary_emb") else None
        counter = DispatchCounter(counts)
        _count_exchange(shard.exchange, counter)
        # What the model's forward hands an attention layer: the "lightning_cp" mask hook's deferred mask
        # (sparse layers slice it for their indexer; with cp_shard nothing builds it); a hybrid's mixer: none.
        mask = DeferredMask({"config": model.config}) if hasattr(layer, "self_attn") else None
        kwargs = {
            "position_embeddings": rope,
            "position_ids": positions,
            "cp_shard": shard,
            "attention_mask": mask,
        }
        with counter, counter.regions(), group.recording(), _autocast(style):
            if checkpointing:
                out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False, **kwargs)
            else:
                out = layer(x, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            counter.backward = True
            out.backward(torch.empty_like(out))
    return counts


def count_loss(
    config: dict[str, Any], tokens: int, style: str = "fsdp", chunk_size: int | None = None
) -> Counts:
    """Forward + backward of the LM head + fused loss (``lightning_cp.ops.linear_cross_entropy``) on
    ``tokens`` local tokens, counted on fake tensors (``chunk_size``: default, the automatic one)."""
    from lightning_cp.ops import linear_cross_entropy

    counts = Counts()
    vocab, hidden_size = config["vocab_size"], config["hidden_size"]
    labels = torch.zeros(tokens, dtype=torch.long)  # real: the loss checks its labels on the host
    with FakeTensorMode(allow_non_fake_inputs=True), gpu_paths():
        dtype = torch.bfloat16 if style == "fsdp" else torch.float32
        weight = torch.empty(vocab, hidden_size, dtype=dtype, requires_grad=True)
        hidden = torch.empty(tokens, hidden_size, dtype=dtype, requires_grad=True)
        counter = DispatchCounter(counts)
        with counter, _autocast(style):
            loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
            counter.backward = True
            loss.backward()
    return counts
