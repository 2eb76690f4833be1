"""The layouts tried, their order, and the longest sequence that fits."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_cp.hf.mixers.kinds import GatedDeltaNetShape
from lightning_cp.models.gpt import GPTConfig
from lightning_cp.plan import Layout, ModelShape, estimate, layouts, max_seq_len, plan

GiB = 2**30
MODELS = Path(__file__).resolve().parents[2] / "examples" / "configs" / "models"


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return ModelShape.from_gpt_config(GPTConfig(vocab_size=32768, n_layer=8, n_head=8, n_embd=1024))


def test_layouts_cover_every_cp_power_of_two_wrapper_and_saving() -> None:
    found = layouts(8)
    assert {layout.cp for layout in found} == {1, 2, 4, 8}
    assert len(found) == 4 * 2 * 6 and len(set(found)) == len(found)
    assert {layout.cp for layout in layouts(6)} == {1, 2}
    with pytest.raises(ValueError, match="gpus=0"):
        layouts(0)


def test_plan_orders_by_communication(shape: ModelShape) -> None:
    candidates = plan(shape, 1 << 16, 8)
    costs = [c.cost() for c in candidates]
    assert costs == sorted(costs)
    first = candidates[0].layout
    assert (first.cp, first.checkpointing, first.tiled, first.offload) == (1, False, False, False)


@pytest.mark.parametrize("layout", [Layout(8, 8), Layout(8, 4, fsdp=True, checkpointing=True, tiled=True)])
def test_max_seq_len_is_the_longest_that_fits(shape: ModelShape, layout: Layout) -> None:
    memory = 20 * GiB
    longest = max_seq_len(shape, layout, memory)
    assert longest > 0 and longest % 1024 == 0
    assert estimate(shape, longest, layout).peak <= memory < estimate(shape, longest + 1024, layout).peak


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
