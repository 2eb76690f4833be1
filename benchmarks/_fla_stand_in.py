"""flash-linear-attention's chunked gated delta rule as the counter sees it on a GPU: two operators (forward,
backward) with its kernels' launches and FLOPs, in place of ``transformers``' torch path.

On a GPU with ``fla`` installed, ``transformers`` resolves a Gated DeltaNet's ``torch_chunk_gated_delta_rule``
(Qwen3.5, Qwen3-Next, OLMo-Hybrid) to ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, which the mixer
adapter (``lightning_cp.hf.mixers.delta_rule``) then calls on each rank's heads of whole sequences. Its
Triton kernels run a fixed number of launches whatever the tokens, where the torch path on the CPU loops over
every chunk of 64 tokens of the sequence (about 150 operators a chunk). ``fla`` does not run here (no CUDA), so
:func:`chunk_gated_delta_rule` stands in for it on fake tensors: its inputs made contiguous as ``fla``'s
``input_guard`` does, then one custom operator forward and one backward, each counted as the launches it stands
for (:data:`LAUNCHES`), with the matmul FLOPs of ``fla``'s kernels (:func:`forward_flops`,
:func:`backward_flops`), in the inputs' dtype as its ``tl.dot`` calls take them.

Read from ``fla-org/flash-linear-attention`` at commit bc3b101 (2026-08-22): ``fla/ops/gated_delta_rule/
chunk.py`` (the launches), ``chunk_fwd.py``, ``wy_fast.py``, ``fla/ops/common/chunk_delta_h.py`` and
``chunk_o.py`` (each kernel's ``tl.dot`` calls). Only counted, never run: no ``fla`` code is used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

CHUNK = 64
"""``fla``'s chunk of tokens (its default, which ``transformers`` keeps)."""
SUB = 16
"""The fused intra-chunk kernel's sub-blocks: ``k k^T`` over the ``10`` lower blocks of ``16 x 16``, the
triangular solve by ``16`` products of ``16 x 16`` blocks (``chunk_gated_delta_rule_fwd_kkt_solve_kernel``)."""
_LOWER_BLOCKS = (CHUNK // SUB) * (CHUNK // SUB + 1) // 2
_SOLVE_PRODUCTS = 16


@torch.library.custom_op("lightning_cp_bench::fla_gated_delta_rule_forward", mutates_args=())
def _forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """``o`` ``[B, T, HV, V]`` of ``q``, ``k`` ``[B, T, H, K]`` (``H`` key heads, each read by ``HV / H`` value
    heads), ``v`` ``[B, T, HV, V]``, the log decay ``g`` and ``beta`` ``[B, T, HV]``."""
    raise NotImplementedError("a stand-in for fla's kernels, counted on fake tensors only")


@torch.library.custom_op("lightning_cp_bench::fla_gated_delta_rule_backward", mutates_args=())
def _backward(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, do: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`_forward`'s inputs from ``do`` ``[B, T, HV, V]``."""
    raise NotImplementedError("a stand-in for fla's kernels, counted on fake tensors only")


@_forward.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    return torch.empty_like(v, dtype=q.dtype)


@_backward.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, do: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(torch.empty_like(x) for x in (q, k, v, g, beta))  # type: ignore[return-value]


def _setup(ctx: Any, inputs: tuple[Tensor, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _gradients(ctx: Any, do: Tensor) -> tuple[Tensor, ...]:
    return _backward(*ctx.saved_tensors, do.contiguous())


_forward.register_autograd(_gradients, setup_context=_setup)

LAUNCHES = {
    torch.ops.lightning_cp_bench.fla_gated_delta_rule_forward: 8,
    torch.ops.lightning_cp_bench.fla_gated_delta_rule_backward: 11,
}
"""The kernel launches each operator stands for. Forward: the l2 norms of ``q`` and ``k``, the decay's chunk
cumsum, ``A``'s zero fill and the fused ``k k^T`` + triangular solve, ``w`` and ``u``, the states, the output.
Backward: ``w`` and ``u`` and the states again, ``dv`` within chunks, the states' gradient, ``dq dk dw dg``, the
WY representation's backward, two in-place sums, the decay's reverse cumsum, the two l2 norms' backward."""


def _per_token(q: torch.Size, v: torch.Size) -> tuple[int, int, int]:
    """``(tokens x value heads, K, V)``: ``fla``'s kernels run per value head over whole chunks (the last padded)."""
    batch, tokens, _, key_dim = q
    return batch * -(-tokens // CHUNK) * CHUNK * v[2], key_dim, v[3]


def forward_flops(q: torch.Size, v: torch.Size) -> int:
    """The forward's matmul FLOPs, per token and value head: ``k k^T`` on the lower sub-blocks and the solve
    (``2 K 10 * 16^2 / 64 + 2 * 16 * 16^3 / 64``), ``w = A k`` and ``u = A v`` (``2 C (K + V)``), the states
    (``v - w h``, ``h += k^T v``: ``4 K V``), the output (``q h``, ``q k^T``, ``(q k^T) v``: ``2 K V + 2 C (K + V)``)."""
    n, key_dim, value_dim = _per_token(q, v)
    intra = 2 * key_dim * _LOWER_BLOCKS * SUB**2 // CHUNK + 2 * _SOLVE_PRODUCTS * SUB**3 // CHUNK
    return n * (intra + 4 * CHUNK * (key_dim + value_dim) + 6 * key_dim * value_dim)


def backward_flops(q: torch.Size, v: torch.Size) -> int:
    """The backward's matmul FLOPs, per token and value head: ``w``, ``u`` and the states recomputed
    (``2 C (K + V) + 4 K V``), ``dv`` within chunks (``2 C (K + V)``), the states' gradient (``6 K V``),
    ``dq dk dw`` (``6 K V + 4 C K + 2 C V``), the WY backward (``10 C K + 4 C V + 4 C^2``): ``16 K V + 18 C K +
    10 C V + 4 C^2``."""
    n, key_dim, value_dim = _per_token(q, v)
    return n * (16 * key_dim * value_dim + 18 * CHUNK * key_dim + 10 * CHUNK * value_dim + 4 * CHUNK**2)


@register_flop_formula(torch.ops.lightning_cp_bench.fla_gated_delta_rule_forward)
def _(q: torch.Size, k: torch.Size, v: torch.Size, *_: Any, **__: Any) -> int:
    return forward_flops(q, v)


@register_flop_formula(torch.ops.lightning_cp_bench.fla_gated_delta_rule_backward)
def _(q: torch.Size, k: torch.Size, v: torch.Size, *_: Any, **__: Any) -> int:
    return backward_flops(q, v)


def chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[Tensor, None]:
    """``fla``'s ``chunk_gated_delta_rule`` as the adapter calls it (``transformers``' torch path's arguments):
    ``(o [B, T, HV, V], None)``. Refuses what ``fla`` refuses (fp32 inputs) and calls other than the adapter's,
    which :data:`LAUNCHES` does not count (a state in or out, no l2 norms)."""
    if query.dtype == torch.float32:
        raise TypeError("fla's chunk_gated_delta_rule refuses float32 inputs (it asserts bf16 or fp16)")
    if initial_state is not None or output_final_state or not use_qk_l2norm_in_kernel:
        raise NotImplementedError(
            "the stand-in counts the adapter's call: q and k l2-normed in the kernel, no recurrent state in or out"
        )
    inputs = [x.contiguous() for x in (query, key, value, g, beta)]  # fla's input_guard
    return _forward(*inputs), None
