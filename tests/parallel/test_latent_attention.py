"""MLA's CP attention from the all-gathered latent against full-sequence attention, on 4 gloo ranks, cp 1, 2, 4.

The reference is independent of the code under test: the latent expanded by hand to every head's keys and
values (``kv_b_proj``'s product, the rotary part repeated per head), then ``scaled_dot_product_attention`` on
the whole sequence (padded) or on every document alone (packed), in float64.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp.parallel import groups, unshard
from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.parallel.latent_attention import latent_attention
from tests.parallel._collectives import recorded_collectives
from tests.parallel._fake_flash import fake_flash
from tests.parallel.test_attention import PACKED_CU, PADDED_SHAPE, _shard_heads

HEADS, RANK, NOPE, ROPE, VALUE = 4, 12, 6, 4, 5
SCALE = 0.3
# Two heads per round: the rounds' slices of kv_b_proj's weight are exercised.
ROUNDS = AttentionMode("allgather", kv_heads_per_gather=2)


def _inputs(batch, total):
    g = torch.Generator().manual_seed(7)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return {
        "q": draw(batch, HEADS, total, NOPE + ROPE),
        "latent": draw(batch, 1, total, RANK),
        "k_rot": draw(batch, 1, total, ROPE),
        "weight": draw(HEADS * (NOPE + VALUE), RANK) / RANK**0.5,
        "dout": draw(batch, HEADS, total, VALUE),
    }


def _reference(x, cu_seqlens):
    """SDPA over the keys and values the latent expands to, on the whole sequence or every document alone."""
    q, latent, k_rot, weight = (x[n].clone().requires_grad_() for n in ("q", "latent", "k_rot", "weight"))
    batch, _, total, _ = q.shape
    expanded = (latent[:, 0] @ weight.T).view(batch, total, HEADS, NOPE + VALUE).transpose(1, 2)
    k = torch.cat([expanded[..., :NOPE], k_rot.expand(-1, HEADS, -1, -1)], dim=-1)
    v = expanded[..., NOPE:]
    bounds = (
        [(0, total)] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    )
    out = torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=SCALE
            )
            for a, b in bounds
        ],
        dim=2,
    )
    out.backward(x["dout"])
    return {
        "out": out.detach(),
        "q": q.grad,
        "latent": latent.grad,
        "k_rot": k_rot.grad,
        "weight": weight.grad,
    }


def _problem(packed):
    cu = PACKED_CU if packed else None
    batch, total = (1, int(PACKED_CU[-1])) if packed else PADDED_SHAPE
    return _inputs(batch, total), cu, total


def _run(packed, attention=ROUNDS, cps=(1, 2, 4), flash=False):
    """On every rank, for each cp: this rank's output and gradients, its weight gradient summed over CP, and the
    collectives it ran (``flash``: through the FlashAttention-2 path, on ``_fake_flash``'s CPU kernels)."""
    x, cu, _ = _problem(packed)
    results = {}
    with fake_flash() if flash else contextlib.nullcontext():
        for cp in cps:
            results[cp] = _run_cp(x, cu, cp, attention)
    return results


def _run_cp(x, cu, cp, attention):
    layout = groups.initialize(tp=1, cp=cp)
    local = {}
    for name in ("q", "latent", "k_rot", "dout"):
        local[name], shard = _shard_heads(x[name], cp, layout.cp_rank, cu, layout.cp_group, attention)
    q, latent, k_rot = (local[n].requires_grad_() for n in ("q", "latent", "k_rot"))
    weight = x["weight"].clone().requires_grad_()
    with recorded_collectives() as calls:
        out = latent_attention(q, latent, k_rot, weight, cp_shard=shard, scale=SCALE, value_dim=VALUE)
        out.backward(local["dout"])
    d_weight = weight.grad.clone()
    if cp > 1:  # what the strategies' gradient sum does over CP
        dist.all_reduce(d_weight, group=layout.cp_group)
    grads = {"out": out.detach(), "q": q.grad, "latent": latent.grad, "k_rot": k_rot.grad}
    groups.destroy()
    return layout.cp_rank, grads, d_weight, calls


def _assemble(per_rank, cp, name, cu, total):
    by_cp_rank = {}
    for results in per_rank:
        rank, grads, _, _ = results[cp]
        by_cp_rank.setdefault(rank, grads[name])  # DP replicas hold the same shard
    shards = [by_cp_rank[r].transpose(1, 2) for r in range(cp)]  # [B, S, H, d]: the sequence in dim 1
    return unshard(shards, seq_len=None if cu is not None else total, cu_seqlens=cu).transpose(1, 2)


@pytest.mark.parametrize(
    ("packed", "flash"),
    [(False, False), (True, False), (True, True)],
    ids=["padded", "packed", "packed-flash"],
)
def test_latent_attention_matches_full_attention_over_the_expanded_keys(world4, packed, flash):
    per_rank = world4.run(_run, packed, flash=flash)
    x, cu, total = _problem(packed)
    expected = _reference(x, cu)
    for cp in (1, 2, 4):
        for name in ("out", "q", "latent", "k_rot"):
            got = _assemble(per_rank, cp, name, cu, total)
            torch.testing.assert_close(got, expected[name], rtol=1e-10, atol=1e-10, msg=f"cp={cp} {name}")
        for results in per_rank:
            torch.testing.assert_close(results[cp][2], expected["weight"], rtol=1e-10, atol=1e-10)


def test_the_exchange_is_the_latent_once_a_layer_not_the_heads(world2):
    """At cp = 2 the forward all-gathers ``[T_local, R + Dr]`` once, the backward gathers it again and
    reduce-scatters its gradient once, whatever the rounds and under Ulysses too; at DeepSeek-V3.2's shape
    that is >= 50x fewer bytes per token than the expanded keys and values the all-gather attention moves."""
    for attention in (ROUNDS, AttentionMode("ulysses")):
        per_rank = world2.run(_run, False, attention, (2,))
        for results in per_rank:
            _, grads, _, calls = results[2]
            local_tokens = grads["q"].shape[0] * grads["q"].shape[2]
            assert [(c.kind, c.shape) for c in calls] == [
                ("all_gather", (local_tokens, RANK + ROPE)),
                ("all_gather", (local_tokens, RANK + ROPE)),
                ("reduce_scatter", (2 * local_tokens, RANK + ROPE)),
            ]
    from transformers import AutoConfig

    config = AutoConfig.for_model("deepseek_v32")
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    key_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    expanded = config.num_attention_heads * (key_dim + config.v_head_dim) * 2
    print(f"DeepSeek-V3.2 bf16 bytes per token per MLA layer: latent {latent}, expanded {expanded}")
    assert (latent, expanded) == (1152, 81920) and expanded / latent >= 50


def test_bad_input_is_refused_by_name():
    x, _, _ = _problem(False)
    with pytest.raises(ValueError, match=r"weight \(kv_b_proj.weight\) must be"):
        latent_attention(
            x["q"], x["latent"], x["k_rot"], x["weight"][1:], cp_shard=None, scale=SCALE, value_dim=VALUE
        )
    with pytest.raises(ValueError, match="latent must be"):
        latent_attention(
            x["q"],
            x["latent"].expand(-1, 2, -1, -1),
            x["k_rot"],
            x["weight"],
            cp_shard=None,
            scale=SCALE,
            value_dim=VALUE,
        )
