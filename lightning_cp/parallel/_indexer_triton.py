"""The Triton kernel of a lightning indexer's scores: one block of queries against a span of keys, in one launch.

The contract is :func:`lightning_cp.parallel.key_indexer.indexer_scores`' (the same arguments, the same result):
``out[t, j] = sum_h w[t, h] * relu(scale * q[t, h] . k[j])`` in fp32, ``-inf`` where key ``j`` is not one of
query ``t``'s. Each program is a tile of :data:`QUERY_TILE` queries by :data:`KEY_TILE` keys: it loads the keys'
tile once, loops over the heads (one ``tl.dot`` of ``[queries, D] x [D, keys]`` each, the activation and the
weighted sum in registers) and writes the tile's scores; a tile none of its queries sees (above the causal
diagonal, or in another packed document) is written ``-inf`` without a product. No ``[b, H, k]`` products exist
(the torch path holds a block of them).

Products run in the inputs' dtype with fp32 accumulation (bf16: exactly what the models' fp32 matmul of their
upcast copies sums); fp32 inputs in full fp32 (no TF32). ``rounding`` (autocast's dtype) rounds the products, their
scaled value, the weights and the sum as the models' autocast matmuls do. Tested in Triton's interpreter on CPU
tensors in fp32 (``tests/parallel/_indexer_triton_cases.py``); bf16 and the speed on a GPU are not measured here.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path runs instead (key_indexer.indexer_scores)
    triton = None

QUERY_TILE = 32
"""Queries per program (at least 16: ``tl.dot``'s smallest block; spare rows are masked)."""
KEY_TILE = 64
"""Keys per program."""
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Input dtypes the kernel takes (float64 runs the torch path)."""


def available(x: Tensor) -> bool:
    """Triton is installed and takes ``x``'s dtype."""
    return triton is not None and x.dtype in DTYPES


def scores(
    queries: Tensor,
    weights: Tensor,
    keys: Tensor,
    first: Tensor,
    last: Tensor,
    scale: float,
    rounding: torch.dtype | None,
) -> Tensor:
    """``queries`` ``[b, H, D]`` and ``weights`` ``[b, H]`` against ``keys`` ``[k, D]``: ``[b, k]`` fp32 scores,
    ``-inf`` outside each query's ``first .. last`` ``[b]`` rows. One launch of ``ceil(b / QUERY_TILE) x
    ceil(k / KEY_TILE)`` programs; no communication."""
    b, heads, dim = queries.shape
    out = torch.empty((b, keys.shape[0]), dtype=torch.float32, device=queries.device)
    if out.numel() == 0:
        return out
    grid = (triton.cdiv(b, QUERY_TILE), triton.cdiv(keys.shape[0], KEY_TILE))
    _scores[grid](
        queries, weights, keys, first, last, out,
        *queries.stride(), *weights.stride(), *keys.stride(), *out.stride(),
        b, keys.shape[0], heads, dim, scale,
        BLOCK_Q=QUERY_TILE, BLOCK_K=KEY_TILE, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        ROUND_TO=_ROUNDING[rounding], PRECISION="ieee" if queries.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


if triton is not None:
    _ROUNDING = {None: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    """The dtype scores are rounded to inside the kernel (fp32: none)."""

    @triton.jit
    def _scores(
        q, w, k, first, last, out,
        sq_t, sq_h, sq_d, sw_t, sw_h, sk_t, sk_d, so_t, so_k,
        n_queries, n_keys, heads, dim, scale,
        BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, ROUND_TO: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        live, real = rows < n_queries, cols < n_keys
        lo = tl.load(first + rows, mask=live, other=n_keys)
        hi = tl.load(last + rows, mask=live, other=-1)
        visible = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None]) & real[None, :]
        acc = tl.zeros((BLOCK_Q, BLOCK_K), tl.float32)
        if tl.max(visible.to(tl.int32)) > 0:  # else no query of the tile sees a key of it
            d = tl.arange(0, BLOCK_D)
            key_tile = tl.load(
                k + cols[:, None] * sk_t + d[None, :] * sk_d,
                mask=real[:, None] & (d[None, :] < dim),
                other=0.0,
            )
            for h in range(heads):
                query_tile = tl.load(
                    q + rows[:, None] * sq_t + h * sq_h + d[None, :] * sq_d,
                    mask=live[:, None] & (d[None, :] < dim),
                    other=0.0,
                )
                products = tl.dot(query_tile, tl.trans(key_tile), input_precision=PRECISION)
                products = products.to(ROUND_TO).to(tl.float32) * scale
                products = tl.maximum(products.to(ROUND_TO).to(tl.float32), 0.0)
                weight = tl.load(w + rows * sw_t + h * sw_h, mask=live, other=0.0).to(ROUND_TO).to(tl.float32)
                acc += weight[:, None] * products
            acc = acc.to(ROUND_TO).to(tl.float32)
        tl.store(
            out + rows[:, None] * so_t + cols[None, :] * so_k,
            tl.where(visible, acc, float("-inf")),
            mask=live[:, None] & real[None, :],
        )
