"""The plan under LoRA and QLoRA: NF4's bytes against ``torchao``'s tensors, the static terms and the
dequantization against hand-computed values, and the layer inputs split between host and GPU where the host
is the bound."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_cp.plan import Layout, ModelShape, estimate
from lightning_cp.plan.lora import NF4_DEQUANTIZE_BYTES, LoRA, nf4_bytes
from lightning_cp.plan.search import candidate
from lightning_cp.plan.terms import pinned_bytes
from tests.plan._measure import PeakTracker
from tests.plan.test_memory import LLAMA_8B

GiB = 2**30


@pytest.fixture(scope="module")
def llama() -> ModelShape:
    pytest.importorskip("transformers")
    return ModelShape.from_hf_config(LLAMA_8B)


def _nf4_module():
    pytest.importorskip("torchao")
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


@pytest.mark.parametrize("size", [(1024, 512), (512, 16384)])
def test_nf4_bytes_are_torchao_s(size: tuple[int, int]) -> None:
    """Every inner tensor of ``to_nf4``'s result (codes, block scales, their factors, mean, code table)."""
    nf4 = _nf4_module().to_nf4(torch.randn(size, dtype=torch.bfloat16))
    names, _ = nf4.__tensor_flatten__()
    real = sum(getattr(nf4, name).untyped_storage().nbytes() for name in names)
    assert nf4_bytes(size[0] * size[1], 1) == real
    assert abs(real / (size[0] * size[1]) - (0.5 + 1 / 64 + 2 / 16384)) < 1e-3


def test_a_dequantization_s_peak_is_the_planned_bytes_per_element() -> None:
    """``linear_nf4``'s forward (and its backward) makes the bf16 weight through ``get_original_weight``: its
    peak is :data:`NF4_DEQUANTIZE_BYTES` per element, within 1%."""
    nf4_tensor = _nf4_module()
    weight = nf4_tensor.to_nf4(torch.randn(2048, 1024, dtype=torch.bfloat16))
    tracker = PeakTracker()
    with tracker:
        weight.get_original_weight()
    planned = NF4_DEQUANTIZE_BYTES * weight.numel()
    assert abs(tracker.peak - planned) <= 0.01 * planned, (tracker.peak, planned)


def test_lora_counts_a_frozen_bf16_base_and_the_adapters_state(llama: ModelShape) -> None:
    """Llama-3-8B, rank 16 on its 7 x 32 linear layers, one GPU under FSDP, ``bf16-mixed``: the base in bf16
    (2 bytes a parameter, no gradient or AdamW state), the adapters with fp32 master weights, gradients and
    AdamW's two states; the head frozen, so the fused loss allocates no head gradient."""
    per_layer = 2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336)  # q, o; k, v; gate, up, down
    adapters = 16 * 32 * per_layer
    assert LoRA(16).adapters(llama) == adapters == 41_943_040
    layout = Layout(1, 1, fsdp=True, checkpointing=True, tiled=True)
    full = estimate(llama, 1 << 16, layout)
    lora = estimate(llama, 1 << 16, layout, lora=LoRA(16))
    assert (lora.parameters, lora.gradients, lora.optimizer) == (
        2 * llama.params + 4 * adapters,
        4 * adapters,
        8 * adapters,
    )
    head = 128256 * 4096
    assert full.loss - lora.loss == 4 * head
    # The same saved tensors, plus every linear's [tokens, 16] down-projection (bf16).
    assert lora.activations == full.activations
    assert lora.recompute - full.recompute == (1 << 16) * 7 * 16 * 2

    # Communication: FSDP gathers the base and the adapters (bf16) for the forward and the backward and
    # reduce-scatters only the adapters' gradients (fp32); DDP all-reduces only those.
    def wrapper(layout: Layout, settings: LoRA | None) -> int:
        return estimate(llama, 1 << 16, layout, lora=settings).communication

    fsdp8, ddp8 = Layout(8, 1, fsdp=True), Layout(8, 1)
    base = 2 * llama.params
    assert wrapper(fsdp8, LoRA(16)) == 2 * (7 * (base + 2 * adapters) // 8) + 7 * (4 * adapters) // 8
    assert wrapper(ddp8, LoRA(16)) == 2 * (7 * (4 * adapters) // 8)


def test_qlora_counts_nf4_linear_weights_and_one_dequantized_weight(llama: ModelShape) -> None:
    """QLoRA: the linear weights in NF4 (0.5157 bytes each), the embeddings, norms and head in bf16; each
    layer's transients hold the largest weight (gate, up or down: 14336 x 4096) dequantized, 14 bytes each."""
    assert llama.linears is not None
    linear = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    assert llama.linears.params == linear and llama.linears.largest == 14336 * 4096
    nf4 = linear // 2 + linear // 64 + linear // 64 // 256 * 2 + 224 * 17 * 2
    base = 2 * (llama.params - linear) + nf4
    assert LoRA(16, "nf4").base_bytes(llama, 2) == base
    layout = Layout(1, 1, fsdp=True, checkpointing=True, offload=True, tiled=True)
    plain = estimate(llama, 1 << 16, layout, lora=LoRA(16))
    quantized = estimate(llama, 1 << 16, layout, lora=LoRA(16, "nf4"))
    assert plain.parameters - quantized.parameters == 2 * llama.params - base
    dequantized = 14 * 14336 * 4096
    assert (quantized.mlp - plain.mlp, quantized.attention - plain.attention) == (dequantized, dequantized)
    assert quantized.recompute - plain.recompute == dequantized
    assert quantized.loss == plain.loss  # the head is bf16: nothing dequantized there


_MOE = {  # a tiny Qwen3-MoE whose linear weights hold whole NF4 blocks of torchao's defaults (64 x 256)
    "model_type": "qwen3_moe",
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 64,
}


def test_lora_and_qlora_of_a_mixture_of_experts_count_what_the_run_builds() -> None:
    """``HFCausalLM(lora=...)`` on a Qwen3-MoE (fused ``[experts, out, in]`` expert weights): ``"all-linear"``
    adapts the ``nn.Linear`` layers only (not the experts or the router, which the setup would refuse), as
    many adapter parameters as the plan counts; QLoRA quantizes those layers' weights and leaves the experts
    bf16 (``to_nf4`` takes 2-D weights only), and the frozen base's bytes (NF4 storage, bf16 tensors) are the
    plan's."""
    pytest.importorskip("peft")
    nf4_tensor = _nf4_module()
    from lightning_cp.hf.lora import check_adapters
    from lightning_cp.models import HFCausalLM

    shape = ModelShape.from_hf_config(_MOE)
    assert shape.linears is not None and shape.linears.expert_params > 0
    module = HFCausalLM(_MOE, dtype="bfloat16", lora={"rank": 4, "quantize": "nf4"})
    module.configure_model()
    check_adapters(module.model, "model", 2)
    adapters = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    assert adapters == LoRA(4).adapters(shape)
    frozen = [p for p in module.model.parameters() if not p.requires_grad]
    quantized = [p for p in frozen if isinstance(p, nf4_tensor.NF4Tensor)]
    assert len(quantized) == shape.linears.count
    assert sum(p.numel() for p in quantized) == shape.linears.params
    experts = [p for p in frozen if p.dim() == 3]
    assert sum(p.numel() for p in experts) == shape.linears.expert_params
    assert all(p.dtype == torch.bfloat16 and not isinstance(p, nf4_tensor.NF4Tensor) for p in experts)

    def stored(p: torch.Tensor) -> int:
        if not isinstance(p, nf4_tensor.NF4Tensor):
            return p.untyped_storage().nbytes()
        names, _ = p.__tensor_flatten__()
        return sum(getattr(p, name).untyped_storage().nbytes() for name in names)

    assert sum(stored(p) for p in frozen) == LoRA(4, "nf4").base_bytes(shape, 2)


def test_the_host_bound_keeps_the_other_layers_inputs_on_the_gpu(llama: ModelShape) -> None:
    """Llama-3-8B with LoRA at 658,432 tokens on one GPU: each layer input is 5 GiB and 24 MiB, held in 80
    pinned pages of 64 MiB and a last one of 24 MiB that PyTorch rounds up to 32 (5,152 MiB, not the 8 GiB
    of one block); with the host memory of 25 such inputs and a half, 25 go to the host, 7 stay on the GPU."""
    layout = Layout(1, 1, fsdp=True, checkpointing=True, offload=True, tiled=True)
    seq, lora, MiB = 658_432, LoRA(16), 2**20
    layer_input = seq * 4096 * 2
    assert layer_input == 5 * GiB + 24 * MiB
    block = 80 * 64 * MiB + 32 * MiB
    full = estimate(llama, seq, layout, lora=lora)
    assert pinned_bytes(layer_input, "cuda") == block and full.host == 32 * block
    found = candidate(llama, seq, layout, lora=lora, host_bytes=25 * block + block // 2)
    assert found.layout == replace(layout, offload_layers=25)
    assert found.estimate.host == 25 * block
    assert found.estimate.activations - full.activations == 7 * layer_input
    assert found.estimate.host_transfer == 2 * 25 * layer_input
    assert found.arguments(llama)["strategy"]["offload_activations"] == 25
    assert candidate(llama, seq, layout, lora=lora, host_bytes=32 * block).layout == layout
    assert candidate(llama, seq, layout, lora=lora, host_bytes=block - 1).layout == layout  # not even one


def test_bad_lora_settings_and_shapes_are_refused(llama: ModelShape) -> None:
    with pytest.raises(ValueError, match="rank=0: give a positive rank"):
        LoRA(0)
    with pytest.raises(ValueError, match="quantize='int8'"):
        LoRA(16, "int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no linear weights counted"):
        estimate(replace(llama, linears=None), 1024, Layout(1, 1), lora=LoRA(16))
    with pytest.raises(ValueError, match="offload_layers=3 needs offload=True"):
        Layout(1, 1, checkpointing=True, offload_layers=3)
