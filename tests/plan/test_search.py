"""The layouts tried, their order, and the longest sequence that fits."""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_cp.hf.mixers.kinds import GatedDeltaNetShape
from lightning_cp.models.gpt import GPTConfig
from lightning_cp.plan import Layout, ModelShape, estimate, layouts, max_seq_len, plan
from lightning_cp.plan.search import MIN_LOSS_CHUNK, Candidate, candidate

GiB = 2**30
MODELS = Path(__file__).resolve().parents[2] / "examples" / "configs" / "models"


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_gpt_config(GPTConfig(vocab_size=32768, n_layer=8, n_head=8, n_embd=1024))


def test_layouts_cover_every_cp_power_of_two_wrapper_and_saving() -> None:
    found = layouts(8)
    assert {layout.cp for layout in found} == {1, 2, 4, 8}
    assert len(found) == 4 * 3 * 6 and len(set(found)) == len(found)  # DDP, FSDP, FSDP + cpu_offload
    assert all(layout.fsdp for layout in found if layout.cpu_offload)
    assert {layout.cp for layout in layouts(6)} == {1, 2}
    with pytest.raises(ValueError, match="gpus=0"):
        layouts(0)


def test_plan_orders_by_communication(shape: ModelShape) -> None:
    candidates = plan(shape, 1 << 16, 8)
    costs = [c.cost() for c in candidates]
    assert costs == sorted(costs)
    first = candidates[0].layout
    assert (first.cp, first.checkpointing, first.tiled, first.offload) == (1, False, False, False)
    # The model state on the host comes after every layout that keeps it on the GPUs.
    offloaded = [c.layout.cpu_offload for c in candidates]
    assert offloaded == sorted(offloaded) and any(offloaded)


@pytest.mark.parametrize("layout", [Layout(8, 8), Layout(8, 4, fsdp=True, checkpointing=True, tiled=True)])
def test_max_seq_len_is_the_longest_that_fits(shape: ModelShape, layout: Layout) -> None:
    memory = 20 * GiB
    longest = max_seq_len(shape, layout, memory)
    assert longest > 0 and longest % 1024 == 0
    assert candidate(shape, longest, layout).fits(memory) and not candidate(
        shape, longest + 1024, layout
    ).fits(memory)


def test_max_seq_len_is_zero_when_nothing_fits(shape: ModelShape) -> None:
    assert max_seq_len(shape, Layout(1, 1), 1 * GiB) == 0


def test_a_hybrid_s_head_counts_cap_cp():
    """Qwen3.5-27B's 48 value / 16 key heads split over any cp up to 16; with 12 value heads, cp 8 does not."""
    shape = ModelShape.from_hf_config(json.loads((MODELS / "qwen3_5_27b.json").read_text()))
    assert shape.mixer is not None and shape.mixer.kind == "gated_deltanet"
    assert (shape.mixer.layers, shape.attention_layers) == (48, 16)
    assert shape.mixer.shape == GatedDeltaNetShape(key_heads=16, value_heads=48, key_dim=128, value_dim=128)
    assert {layout.cp for layout in layouts(16, shape)} == {1, 2, 4, 8, 16}
    fewer = replace(shape, mixer=replace(shape.mixer, shape=GatedDeltaNetShape(4, 12, 128, 128)))
    assert {layout.cp for layout in layouts(16, fewer)} == {1, 2, 4}
    assert {c.layout.cp for c in plan(fewer, 1 << 14, 16)} == {1, 2, 4}


def test_a_mixture_of_experts_counts_top_k_experts_per_token_and_every_parameter():
    config = {
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 1024,
        "moe_intermediate_size": 128,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 1000,
    }
    shape = ModelShape.from_hf_config(config)
    assert (shape.experts, shape.top_k, shape.expert_ffn, shape.ffn, shape.mlp_width) == (16, 4, 128, 0, 512)
    experts = 2 * 16 * 3 * 256 * 128  # every expert's gate, up and down projections, in both layers
    assert shape.params > experts + 2 * 1000 * 256


def test_the_model_state_on_the_host_frees_the_gpu_of_it_and_is_checked_against_the_host() -> None:
    """Llama-3-8B on one GPU: under ``cpu_offload`` the 16 bytes per parameter of fp32 weights, gradients and
    AdamW are host memory, one unit's fp32 shard is copied in beside its bf16 gathered copy, and each step
    copies the shards in twice (forward and backward gathers) and the gradients out once."""
    llama = ModelShape.from_hf_config(json.loads((MODELS / "llama3_8b.json").read_text()))
    on_gpu = Layout(1, 1, fsdp=True, checkpointing=True, offload=True, tiled=True)
    on_host = replace(on_gpu, cpu_offload=True)
    seq = 1 << 16
    gpu, host = estimate(llama, seq, on_gpu), estimate(llama, seq, on_host)
    state = 16 * llama.params
    assert (
        gpu.parameters + gpu.gradients + gpu.optimizer,
        host.parameters + host.gradients + host.optimizer,
    ) == (
        state,
        0,
    )
    # FSDP2 pins each parameter's shard and each gradient's in a block of its own, which PyTorch's caching host
    # allocator rounds up to a power of two on CUDA: Llama-3-8B's 224 MiB MLP weights take 256 MiB each.
    import torch
    import transformers

    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**json.loads((MODELS / "llama3_8b.json").read_text()))
        )
    pinned = sum(1 << (4 * p.numel() - 1).bit_length() for p in built.parameters())
    assert pinned > 1.1 * 4 * llama.params
    assert abs(host.host - gpu.host - (2 * pinned + 8 * llama.params)) <= 1
    on_the_cpu = (
        estimate(llama, seq, on_host, device="cpu").host - estimate(llama, seq, on_gpu, device="cpu").host
    )
    assert on_the_cpu == state
    assert host.fsdp_gathered - gpu.fsdp_gathered == 4 * llama.layer_params
    inputs = 2 * gpu.host  # the offloaded layer inputs out and back
    assert (gpu.host_transfer, host.host_transfer) == (inputs, inputs + 3 * 4 * llama.params)
    assert host.peak < gpu.peak - 100 * GiB
    found = candidate(llama, seq, on_host)
    assert (
        found.fits(80 * GiB) and found.fits(80 * GiB, host.host) and not found.fits(80 * GiB, host.host - 1)
    )
    with pytest.raises(ValueError, match="set fsdp=True"):
        Layout(1, 1, cpu_offload=True)


def test_the_loss_chunk_is_planned_down_to_the_next_transient_when_the_loss_bounds_the_peak() -> None:
    """Qwen3-8B at 1M tokens on 8 GPUs: with the automatic chunk the fused loss (two fp32 ``[chunk, vocab]``
    blocks of a 151,936 vocabulary) is the largest transient; the planned chunk brings it down to the next one,
    which then bounds the peak."""
    qwen = ModelShape.from_hf_config(json.loads((MODELS / "qwen3_8b.json").read_text()))
    layout = Layout(8, 8, fsdp=True, checkpointing=True, offload=True, tiled=True, attention="ulysses")
    automatic = estimate(qwen, 1 << 20, layout)
    assert automatic.largest_transient == "loss"
    planned = candidate(qwen, 1 << 20, layout)
    chunk = planned.loss_chunk
    assert chunk is not None and chunk % MIN_LOSS_CHUNK == 0
    assert planned.estimate == estimate(qwen, 1 << 20, layout, loss_chunk=chunk)
    others = max(automatic.counted_transient(name) for name in ("attention", "mlp", "recompute"))
    assert (
        planned.estimate.loss
        <= others
        < estimate(qwen, 1 << 20, layout, loss_chunk=chunk + MIN_LOSS_CHUNK).loss
    )
    assert planned.estimate.transient == others and planned.estimate.peak < automatic.peak
    # A given chunk is kept, and a layout whose peak another transient bounds keeps the automatic one.
    assert candidate(qwen, 1 << 20, layout, loss_chunk=4096).loss_chunk == 4096
    bounded = Layout(8, 8, fsdp=True, checkpointing=True)
    assert estimate(qwen, 1 << 20, bounded).largest_transient != "loss"
    assert candidate(qwen, 1 << 20, bounded).loss_chunk is None


def test_a_candidate_s_arguments_are_the_strategy_s_and_the_model_s() -> None:
    llama = ModelShape.from_hf_config(json.loads((MODELS / "llama3_8b.json").read_text()))
    layout = Layout(8, 4, fsdp=True, checkpointing=True, offload=True, tiled=True, kv_heads_per_gather=1)
    found = Candidate(replace(layout, cpu_offload=True), estimate(llama, 1 << 16, layout), loss_chunk=2048)
    assert found.arguments(llama) == {
        "strategy": {
            "cp": 4,
            "activation_checkpointing": ["LlamaDecoderLayer"],
            "offload_activations": True,
            "kv_heads_per_gather": 1,
            "cpu_offload": True,
        },
        "model": {"tiled": True, "chunk_size": 2048},
    }
    plain = Candidate(Layout(8, 2, attention="ulysses"), estimate(llama, 1 << 16, Layout(8, 2)))
    assert plain.arguments(llama) == {"strategy": {"cp": 2, "cp_attention": "ulysses"}, "model": {}}


@pytest.mark.parametrize("architecture", ["gpt", "hf"])
def test_every_layout_s_arguments_are_taken_by_the_classes_its_config_names(
    architecture: str, shape: ModelShape
) -> None:
    """Each layout option is tied to the class that takes it: for every layout tried on 8 GPUs (with a loss
    chunk), the strategy builds from its arguments, and the module class of the model's architecture (the
    package GPT's ``GPTModule``, ``transformers``' ``HFCausalLM``) has a parameter for each of its own."""
    if architecture == "hf":
        shape = ModelShape.from_hf_config(json.loads((MODELS / "llama3_8b.json").read_text()))

    def named(path: str) -> type:
        module, name = path.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)

    built, model_options = set(), set()
    for found in plan(shape, 1 << 16, 8, precision="bf16-true", loss_chunk=2048):
        config = found.config(shape)
        assert config["trainer"]["precision"] == "bf16-true"
        strategy = config["trainer"]["strategy"]
        arguments = json.dumps(strategy, sort_keys=True)
        if arguments not in built:
            named(strategy["class_path"])(**strategy["init_args"])
            built.add(arguments)
        module = named(config["model"]["class_path"])
        assert module.__name__ == {"gpt": "GPTModule", "hf": "HFCausalLM"}[architecture]
        init_args = config["model"].get("init_args", {})
        inspect.signature(module).bind_partial(**init_args)
        model_options |= set(init_args)
    assert model_options == {"tiled", "chunk_size"}
