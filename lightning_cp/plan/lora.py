"""What LoRA and QLoRA change in the plan: a frozen base, the adapters' state, and NF4's bytes.

LoRA (``peft``, ``target_modules="all-linear"``: every ``nn.Linear`` of the decoder, not the LM head) freezes
the base: its weights are held in the compute dtype (bf16 under ``bf16-mixed`` / ``bf16-true``), with no
master copy, gradient or optimizer state, and only the adapters (``A: [r, in]``, ``B: [out, r]`` per linear)
are trained in the master dtype (fp32 under ``bf16-mixed``). QLoRA keeps those linear weights as ``torchao``'s
NF4 tensor (``torchao.quantization.quantize_.workflows.nf4.nf4_tensor.to_nf4``, 64-element blocks, their
scales double-quantized in blocks of 256), as ``HFCausalLM``'s QLoRA does (:mod:`lightning_cp.hf.qlora`); the
embeddings, norms, LM head and a mixture of experts' fused expert weights stay in bf16 (``to_nf4`` takes 2-D
weights only, and ``NF4Tensor`` has no grouped or per-expert matmul for the experts' ``[experts, out, in]``
parameters: their NF4 would need a kernel of its own). The byte counts here are
``torchao``'s tensors' (``tests/plan/test_lora.py`` holds them against ``to_nf4`` on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_cp.plan.shape import LinearWeights, ModelShape

NF4_BLOCK = 64
"""Elements per NF4 block (``to_nf4``'s ``block_size``): one int8 double-quantized scale each."""
NF4_SCALER_BLOCK = 256
"""Block scales per second-level block (``scaler_block_size``): one quantization factor each."""
NF4_TABLE = 16
"""Entries of the NF4 code table every tensor holds (in the original dtype), beside one ``scaler_mean``."""
NF4_DEQUANTIZE_BYTES = 14
"""Peak bytes per element of ``NF4Tensor.get_original_weight`` (what ``linear_nf4`` runs in its forward and
again in its backward): the two int64 index tensors of the packed halves (4 + 4), their bf16 code values
(1 + 1), the scales repeated over each half (a bf16 copy made twice, 1 + 1) and the two scaled halves (1 + 1),
beside which the bf16 weight is built. Measured on the CPU: 14.05 (tests/plan/test_lora.py)."""

Quantize = Literal["nf4"]


def nf4_bytes(elements: int, matrices: int, dtype_bytes: int = 2) -> int:
    """Bytes of ``matrices`` NF4 tensors of ``elements`` in all, quantized from a ``dtype_bytes`` dtype:
    ``elements / 2`` (two 4-bit codes a byte) ``+ elements / 64`` (int8 block scales) ``+ elements / 16384 *
    dtype_bytes`` (the scales' quantization factors), and per tensor its code table and ``scaler_mean``
    (``17 * dtype_bytes``): 0.5157 bytes per element from bf16."""
    blocks = elements // NF4_BLOCK
    return (
        elements // 2
        + blocks
        + blocks // NF4_SCALER_BLOCK * dtype_bytes
        + matrices * (NF4_TABLE + 1) * dtype_bytes
    )


@dataclass(frozen=True)
class LoRA:
    """LoRA adapters of rank :attr:`rank` on every linear layer of the decoder, with the base in bf16 or,
    with :attr:`quantize`, its linear weights in NF4 (QLoRA). Dropout 0: a dropout would save a mask and the
    dropped input of every linear."""

    rank: int = 16
    quantize: Quantize | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank}: give a positive rank, e.g. 16.")
        if self.quantize not in (None, "nf4"):
            raise ValueError(f"LoRA quantize={self.quantize!r}: give None or 'nf4'.")

    def argument(self) -> dict[str, object]:
        """``HFCausalLM(lora=...)``: the settings this plans (``alpha`` twice the rank, no dropout)."""
        return {
            "rank": self.rank,
            "alpha": 2 * self.rank,
            "dropout": 0.0,
            "target_modules": "all-linear",
            "quantize": self.quantize,
        }

    def adapters(self, shape: ModelShape) -> int:
        """Trained parameters: ``rank * (in + out)`` per linear."""
        return self.rank * _linears(shape).dims

    def base_bytes(self, shape: ModelShape, compute_bytes: int) -> int:
        """The frozen base: every parameter in the compute dtype, but under QLoRA the ``nn.Linear`` weights in NF4
        (:func:`nf4_bytes`; a mixture of experts' fused expert weights stay in the compute dtype)."""
        if self.quantize is None:
            return shape.params * compute_bytes
        linears = _linears(shape)
        return (shape.params - linears.params) * compute_bytes + nf4_bytes(
            linears.params, linears.count, compute_bytes
        )

    def layer_base_bytes(self, shape: ModelShape, compute_bytes: int) -> int:
        """One decoder layer's frozen base (what one FSDP unit gathers of it): the base's bytes outside the
        embedding and the LM head, over the layers."""
        embeddings = (1 if shape.tied else 2) * shape.vocab * shape.hidden * compute_bytes
        return (self.base_bytes(shape, compute_bytes) - embeddings) // shape.layers

    def saved_per_token(self, shape: ModelShape, compute_bytes: int) -> int:
        """Bytes one layer's adapters save per token beyond the base's tensors (the average layer): each
        linear's ``[tokens, r]`` down-projection, which ``B`` saves for its gradient (``A`` saves the linear's
        input, which the layer saves anyway)."""
        return -(-_linears(shape).count // shape.layers) * self.rank * compute_bytes

    def dequantized_bytes(self, shape: ModelShape) -> int:
        """QLoRA's transient (0 without): one dequantization of the largest quantized (``nn.Linear``) weight
        (:data:`NF4_DEQUANTIZE_BYTES` per element), in a linear's forward or backward."""
        return _linears(shape).largest * NF4_DEQUANTIZE_BYTES if self.quantize else 0


def _linears(shape: ModelShape) -> LinearWeights:
    if shape.linears is None or shape.linears.count == 0:
        raise ValueError(
            "LoRA: the model shape has no linear weights counted; build it with ModelShape.from_hf_config "
            "or from_gpt_config."
        )
    return shape.linears
