"""The plan's arithmetic: how each layout choice moves bytes between the terms (tests/plan/test_measured.py
holds the terms themselves against measurement)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lightning_cp.models.gpt import GPTConfig
from lightning_cp.plan import Layout, ModelShape, estimate, local_tokens

LLAMA_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
}


@pytest.fixture(scope="module")
def llama() -> ModelShape:
    pytest.importorskip("transformers")
    return ModelShape.from_hf_config(LLAMA_8B)


def test_llama_3_8b_shape_and_parameter_count(llama: ModelShape) -> None:
    assert (llama.q_dim, llama.kv_dim, llama.head_dim) == (4096, 1024, 128)
    assert llama.params == 8_030_261_248  # Meta's published count for Llama-3-8B
    assert not llama.tied


def test_local_tokens_pad_to_two_chunks_per_rank() -> None:
    assert local_tokens(1 << 20, 8) == 1 << 17
    assert local_tokens(10, 4) == 4  # padded to 16 tokens, 2 chunks of 2 per rank
    assert local_tokens(1, 1) == 2


def test_fsdp_divides_static_bytes_by_every_rank_and_ddp_adds_buckets(llama: ModelShape) -> None:
    ddp = estimate(llama, 8192, Layout(gpus=8, cp=4))
    fsdp = estimate(llama, 8192, Layout(gpus=8, cp=4, fsdp=True))
    single = estimate(llama, 8192, Layout(gpus=1, cp=1))
    params = llama.params
    assert ddp.parameters == 4 * params and ddp.optimizer == 8 * params
    assert ddp.gradients == 8 * params  # fp32 gradients and DDP's bucket copy of them
    assert single.gradients == 4 * params  # one replica: no DDP wrapper, no buckets
    assert fsdp.parameters == 4 * -(-params // 8) and fsdp.optimizer == 8 * -(-params // 8)
    assert ddp.fsdp_gathered == 0
    # The root (Llama-3-8B's untied head and final norm; its embedding is a unit of its own) in bf16 for the
    # step, two decoder units' bf16 parameters and one unit's bf16 and fp32 gradients.
    root = params - llama.layers * llama.layer_params - llama.vocab * llama.hidden
    assert llama.vocab * llama.hidden <= root <= llama.vocab * llama.hidden + llama.hidden
    assert fsdp.fsdp_gathered == 2 * root + llama.layer_params * (2 * 2 + 2 + 4)
    true_bf16 = estimate(llama, 8192, Layout(gpus=8, cp=4, fsdp=True), precision="bf16-true")
    assert true_bf16.parameters * 2 == fsdp.parameters and true_bf16.optimizer * 2 == fsdp.optimizer


def test_checkpointing_keeps_layer_inputs_and_offload_moves_them_to_the_host(llama: ModelShape) -> None:
    seq, cp = 1 << 17, 8
    tokens = local_tokens(seq, cp)
    plain = estimate(llama, seq, Layout(gpus=8, cp=cp))
    ckpt = estimate(llama, seq, Layout(gpus=8, cp=cp, checkpointing=True))
    offload = estimate(llama, seq, Layout(gpus=8, cp=cp, checkpointing=True, offload=True))
    inputs = llama.layers * tokens * llama.hidden * 4  # DDP's bf16-mixed: an fp32 residual stream
    assert ckpt.activations - offload.activations == inputs == offload.host
    # FSDP gathers the weights in bf16, so the embedding and every hidden state are bf16.
    sharded = Layout(gpus=8, cp=cp, fsdp=True, checkpointing=True, offload=True)
    assert estimate(llama, seq, sharded).host == inputs // 2
    assert plain.activations > 10 * ckpt.activations
    assert plain.recompute == 0 < ckpt.recompute
    assert ckpt.communication > plain.communication  # the recomputed forward gathers K/V once more


@pytest.mark.parametrize(("tiled", "copies"), [(True, 2), (False, 1)], ids=["tiled", "untiled-bf16-stream"])
def test_a_recomputed_layer_under_offload_holds_its_input_brought_back_and_the_previous_one_s(
    llama: ModelShape, tiled: bool, copies: int
) -> None:
    """memory/offload.py brings a layer's own input back when its recomputation starts and prefetches the
    previous layer's, held through this layer's backward. Beside checkpointing alone: tiled, the first norm
    saves the copy brought back instead of the checkpoint's saved input (two `[T, d]` inputs more); untiled
    in a bf16 stream, it saves an fp32 copy either way and the input brought back is freed after the
    recomputed forward (one more). A model of one layer prefetches nothing."""
    seq = 1 << 20  # one GPU, FSDP's bf16 stream: 8 GiB per layer input
    layer_input = seq * llama.hidden * 2
    ckpt = Layout(gpus=1, cp=1, fsdp=True, checkpointing=True, tiled=tiled)
    offload = replace(ckpt, offload=True)
    rise = estimate(llama, seq, offload).recompute - estimate(llama, seq, ckpt).recompute
    assert rise == copies * layer_input
    one_layer = replace(llama, layers=1)
    one_rise = estimate(one_layer, seq, offload).recompute - estimate(one_layer, seq, ckpt).recompute
    assert one_rise == (copies - 1) * layer_input


def test_offloaded_inputs_take_their_pinned_pages_on_cuda(llama: ModelShape) -> None:
    """On CUDA the offload holds each input in pinned pages of 64 MiB (the last one shorter) from PyTorch's
    caching host allocator, which rounds every block up to a power of two (torch 2.13,
    ``ATen/core/CachingHostAllocator.h``): the full pages take their size, the last one its power of two. On
    the CPU the pages are plain tensors. At 1,125,376 tokens on one GPU each bf16 layer input is 137 pages and
    24 MiB: 137 pages and 32 MiB on the host (8.6 GiB, not the 16 GiB of one block)."""
    MiB, seq = 2**20, 1_125_376
    layer_input = seq * llama.hidden * 2
    assert layer_input == 137 * 64 * MiB + 24 * MiB
    layout = Layout(gpus=1, cp=1, fsdp=True, checkpointing=True, offload=True, tiled=True)
    pinned = 137 * 64 * MiB + 32 * MiB
    assert estimate(llama, seq, layout).host == llama.layers * pinned
    assert estimate(llama, seq, layout, device="cpu").host == llama.layers * layer_input
    assert estimate(llama, seq, layout).host_transfer == 2 * llama.layers * layer_input  # bytes copied
    # Whole pages are their own size: 1M tokens, 8 GiB per layer (128 pages).
    assert estimate(llama, 1 << 20, layout).host == llama.layers * 8 * 2**30
    # An input shorter than a page is one block: 40 MiB (5,120 tokens) takes 64.
    assert estimate(llama, 5 * 1024, layout).host == llama.layers * 64 * MiB


@pytest.mark.parametrize(
    ("fsdp", "stream"), [(False, 4), (True, 2)], ids=["ddp-fp32-stream", "fsdp-bf16-stream"]
)
def test_tiles_remove_the_ffn_intermediates_and_the_norms_fp32_copies(
    llama: ModelShape, fsdp: bool, stream: int
) -> None:
    seq, d = 1 << 20, llama.hidden
    tokens = local_tokens(seq, 8)
    plain = estimate(llama, seq, Layout(gpus=8, cp=8, fsdp=fsdp))
    tiled = estimate(llama, seq, Layout(gpus=8, cp=8, fsdp=fsdp, tiled=True))
    # SwiGLU saves gate, up, activation and product per layer in bf16. A norm saves an fp32 copy of its
    # input (the input itself in an fp32 stream), its fp32 reciprocal RMS and its normalized input in the
    # stream's dtype, and its readers its bf16 output; tiled, its input, and its readers none of its output.
    mlp = 4 * llama.ffn * 2
    norms = 2 * (4 * d + 4 + stream * d + 2 * d) - 2 * stream * d
    per_layer = mlp + norms
    final_norm = 4 * d + 4
    assert plain.activations - tiled.activations == tokens * (llama.layers * per_layer + final_norm)
    assert tiled.mlp < plain.mlp / 2
    # One tile has hidden-size tokens whatever the length: its SwiGLU buffers stay [4096, ffn].
    longer = estimate(llama, 4 * seq, Layout(gpus=8, cp=8, fsdp=fsdp, tiled=True))
    assert longer.mlp - tiled.mlp == 2 * 3 * tokens * d * 2  # only the [tokens, d] gradients grow


def test_attention_transient_is_three_copies_of_a_round_s_kv_or_ulysses_buffers(llama: ModelShape) -> None:
    seq = 1 << 20
    kv = 2 * seq * llama.kv_dim * 2  # K and V of every token, bf16
    local = 2 * local_tokens(seq, 8) * (llama.q_dim + llama.kv_dim) * 2
    assert estimate(llama, seq, Layout(gpus=8, cp=8)).attention == 3 * kv + local
    by_head = estimate(llama, seq, Layout(gpus=8, cp=8, kv_heads_per_gather=1))
    assert by_head.attention == 3 * kv // llama.kv_heads + local  # one key/value head per round
    assert by_head.communication == estimate(llama, seq, Layout(gpus=8, cp=8)).communication
    assert estimate(llama, seq, Layout(gpus=8, cp=1)).attention == local * 8  # no K/V copies without CP
    # Ulysses: the heads' side gradients (replicated key/value heads: max(Hkv, cp) of them) and what the two
    # all-to-alls carry, no sequence-sized copy.
    ulysses = estimate(llama, seq, Layout(gpus=8, cp=8, attention="ulysses"))
    tokens = local_tokens(seq, 8)
    assert (
        ulysses.attention
        == 2 * tokens * (llama.q_dim + llama.kv_dim) * 2 + tokens * 2 * (llama.q_dim + llama.kv_dim) * 2
    )
    assert ulysses.communication < by_head.communication  # two all-to-alls of the local q, k, v, out


@pytest.mark.parametrize("kv_heads", [2, 8], ids=["replicated-kv-heads", "split-kv-heads"])
def test_ulysses_counts_each_rank_s_key_value_heads_replicated_when_fewer_than_cp(
    llama: ModelShape, kv_heads: int
) -> None:
    """Under Ulysses each of cp = 8 ranks holds every token of ``Hq / cp`` query heads and of
    ``max(1, Hkv / cp)`` key/value heads: with 2 key/value heads, each of them is replicated on 4 ranks. The
    saved tensors (beyond the all-gather's: those heads' K and V, and the output brought back), the
    attention's transient (the heads' side gradients and the all-to-alls' buffers) and the bytes sent count
    them."""
    shape = replace(llama, kv_heads=kv_heads)
    seq, cp, compute = 1 << 20, 8, 2
    tokens = local_tokens(seq, cp)
    heads_side_kv = cp * tokens * max(1, kv_heads // cp) * shape.head_dim  # one rank's K (and as much V)
    gathered = estimate(shape, seq, Layout(gpus=cp, cp=cp))
    ulysses = estimate(shape, seq, Layout(gpus=cp, cp=cp, attention="ulysses"))
    extra = tokens * shape.q_dim + 2 * (heads_side_kv - tokens * shape.kv_dim)
    assert ulysses.activations - gathered.activations == shape.layers * extra * compute
    exchanged = (2 * tokens * shape.q_dim + 2 * heads_side_kv) * compute  # q, k, v to the heads, out back
    assert ulysses.attention == 2 * (tokens * shape.q_dim + heads_side_kv) * compute + exchanged
    all_reduce = 2 * (cp - 1) * shape.params * 4 // cp  # DDP's fp32 gradients
    assert ulysses.communication - all_reduce == 2 * shape.layers * (exchanged * (cp - 1) // cp)


def test_loss_transient_follows_the_chunk(llama: ModelShape) -> None:
    small = estimate(llama, 1 << 17, Layout(gpus=8, cp=8), loss_chunk=1024)
    large = estimate(llama, 1 << 17, Layout(gpus=8, cp=8), loss_chunk=4096)
    assert large.loss - small.loss == 2 * 3072 * llama.vocab * 4  # two fp32 [chunk, vocab] blocks


def test_peak_is_the_sum_with_the_largest_transient_and_the_reserve(llama: ModelShape) -> None:
    est = estimate(llama, 1 << 17, Layout(gpus=8, cp=8, fsdp=True, checkpointing=True))
    assert est.transient == est.counted_transient(est.largest_transient)
    static = est.parameters + est.gradients + est.optimizer + est.fsdp_gathered
    assert est.counted == static + est.activations + est.transient
    assert est.peak == est.counted + est.reserve and est.reserve >= 2 * 2**30
    assert est.as_dict()["peak"] == est.peak


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus": 6, "cp": 4}, "multiple of cp=4"),
        ({"gpus": 4, "cp": 2, "offload": True}, "checkpointing=True"),
    ],
)
def test_bad_layouts_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_bad_estimate_arguments_are_refused() -> None:
    shape = ModelShape.from_gpt_config(GPTConfig())
    with pytest.raises(ValueError, match="precision='fp8'"):
        estimate(shape, 1024, Layout(1, 1), precision="fp8")
    with pytest.raises(ValueError, match="seq_len=0"):
        estimate(shape, 0, Layout(1, 1))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"hidden_size": 64}, "no 'model_type'"),
        ({"model_type": "lama"}, "lama"),
    ],
)
def test_bad_hf_configs_are_one_line_errors(config: dict, message: str) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=message) as error:
        ModelShape.from_hf_config(config)
    assert "\n" not in str(error.value)


def test_hf_directory_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        ModelShape.from_hf_config(tmp_path)
