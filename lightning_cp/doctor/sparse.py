"""Self-checks of a sparse attention layer (DeepSeek Sparse Attention) under CP: the indexer's top-k keys and
the attention over them against the dense selection and masked attention on each whole document.

Every rank of a simulated group of :data:`CP` (:mod:`lightning_cp.doctor._ranks`) shards the packed batch of
the attention checks and an indexer's queries, weights and keys, selects its queries' keys with
:func:`~lightning_cp.parallel.key_indexer.select_topk_keys` (which all-gathers the indexer keys) and runs
:func:`~lightning_cp.parallel.context_parallel_attention` over them (``selected=``: the sparse attention, which
all-gathers the keys and values and reduce-scatters their gradients), forward and backward. The reference is
the model's computation on each whole document: the indexer's ``[S, S]`` scores in fp32, the causal mask, the
top-k, and SDPA under that selection as its mask, in float64 on the CPU (and PyTorch's own in the inputs'
dtype on the device, for the tolerance). Outputs and dQ / dK / dV of the real tokens are compared; a key
selected wrongly moves the output far above the rounding. The draw has no tie at any query's top-k-th score
(where the model's own choice would be arbitrary).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_cp.doctor._compare import CheckResult, compare, dtype_name, run_check
from lightning_cp.doctor._ranks import CheckRanks, SimulatedRanks
from lightning_cp.doctor.attention import attention_inputs, rank_triples
from lightning_cp.parallel import context_parallel_attention
from lightning_cp.parallel.key_indexer import select_topk_keys

CP = 4
"""The CP size of the simulated group."""
INDEX_HEADS, INDEX_DIM, TOPK, INDEX_SCALE = 8, 16, 16, 0.35
"""The indexer: its heads and head size, the keys each query reads (``index_topk``) and its score scale."""


def sparse_checks(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> list[CheckResult]:
    """One result per dtype: every rank of a simulated group of :data:`CP` vs the dense selection and masked
    SDPA on each document (see the module docstring)."""
    results = []
    for dtype in dtypes:
        name = f"sparse attention top-{TOPK} cp={CP} packed gqa {dtype_name(dtype)}"
        results.append(run_check(name, _simulated, device, dtype))
    return results


def indexer_inputs(tokens: int) -> dict[str, Tensor]:
    """The indexer's ``iq`` ``[1, H_i, T, D_i]``, ``iw`` ``[1, H_i, T, 1]`` and ``ik`` ``[1, 1, T, D_i]`` (fp32,
    in the attention inputs' ``[B, heads, S, d]`` layout, so that they are sharded alike)."""
    g = torch.Generator().manual_seed(6)  # its least gap at a top-k-th score: 2e-4 of the largest score
    return {
        "iq": torch.randn(1, INDEX_HEADS, tokens, INDEX_DIM, generator=g),
        "iw": torch.randn(1, INDEX_HEADS, tokens, 1, generator=g),
        "ik": torch.randn(1, 1, tokens, INDEX_DIM, generator=g),
    }


def dense_selection(index: dict[str, Tensor], cu_seqlens: Tensor) -> Tensor:
    """``[T, T]`` bool: key ``j`` among query ``i``'s top :data:`TOPK` of its document, as the model selects them
    on the whole document (fp32 scores ``sum_h w * relu(scale * q . k)``, causal, ``topk``)."""
    tokens = index["iq"].shape[2]
    mask = torch.zeros(tokens, tokens, dtype=torch.bool)
    for a, b in itertools.pairwise(cu_seqlens.tolist()):
        q, w, k = index["iq"][0, :, a:b], index["iw"][0, :, a:b, 0], index["ik"][0, 0, a:b]
        scores = (w[:, :, None] * torch.relu(q @ k.T * INDEX_SCALE)).sum(0)  # [S, S]
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        top = scores.masked_fill(~causal, float("-inf")).topk(min(TOPK, b - a), dim=-1).indices
        mask[a:b, a:b] = torch.zeros_like(causal).scatter(-1, top, True) & causal
    return mask


def masked_reference(
    q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, dq, dk, dv)`` of SDPA of ``[1, H, T, d]`` inputs under ``mask`` ``[T, T]`` (the dense selection,
    which keeps documents apart), K/V heads repeated for grouped-query attention; where and in the dtype the
    inputs are."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.to(q.device))
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def check_sparse(name: str, ranks: CheckRanks, device: torch.device, dtype: torch.dtype) -> CheckResult:
    """The top-k selection and sparse attention on the shards of ``ranks`` on ``device``, inputs in ``dtype``,
    against the dense selection and masked SDPA on each whole document in float64 (see the module docstring)."""
    q, k, v, grad_out, cu = attention_inputs("packed", dtype)
    index = indexer_inputs(q.shape[2])
    mask = dense_selection(index, cu)
    references = masked_reference(*(t.double() for t in (q, k, v, grad_out)), mask)
    torchs = masked_reference(*(t.to(device) for t in (q, k, v, grad_out)), mask)
    tensors = {n: t.to(device) for n, t in {**dict(zip("qkvg", (q, k, v, grad_out))), **index}.items()}

    def forward(shard: dict, leaves: tuple[Tensor, ...]) -> Tensor:
        iq, iw, ik = (shard[n].transpose(1, 2).flatten(0, 1) for n in ("iq", "iw", "ik"))  # token-major
        selected = select_topk_keys(iq, iw[..., 0], ik[:, 0], shard["cp_shard"], TOPK, INDEX_SCALE)
        return context_parallel_attention(*leaves, cp_shard=shard["cp_shard"], selected=selected.int())

    triples, exchanges = rank_triples(ranks, tensors, cu, forward, (references, torchs))
    return compare(name, dtype, triples, f"[fwd: {', '.join(exchanges) or 'no exchange'}]")


def _simulated(name: str, device: torch.device, dtype: torch.dtype) -> CheckResult:
    return check_sparse(name, SimulatedRanks(CP), device, dtype)
