"""A way to train on a number of GPUs, as the plan names it: CP size, wrapper, attention, memory savings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_cp.parallel.attention_mode import AttentionMode


@dataclass(frozen=True)
class Layout:
    """One way to train on ``gpus`` ranks: the CP size (``dp = gpus // cp``), the wrapper, and the
    activation-memory savings."""

    gpus: int
    """Ranks in all (``dp * cp``)."""
    cp: int
    """Context-parallel size; every sequence is split over ``cp`` ranks."""
    fsdp: bool = False
    """FSDP2 over the ``dp * cp`` ranks (``MegatronCPFSDPStrategy``) instead of DDP."""
    checkpointing: bool = False
    """Activation checkpointing of every decoder layer (``activation_checkpointing=[<layer class>]``)."""
    offload: bool = False
    """The checkpointed layers' inputs moved to host memory (needs ``checkpointing``)."""
    tiled: bool = False
    """``HFCausalLM(tiled=True)``: ``lightning_cp.memory.tile_mlps``, ``tile_norms`` and ``tile_experts``: the
    MLP's ``[tokens, ffn]`` intermediates, a mixture of experts' expert activations and the norms' fp32 copies
    recomputed per tile, only their inputs saved."""
    attention: Literal["allgather", "ulysses"] = "allgather"
    """The strategies' ``cp_attention``: the key/value heads all-gathered, or Ulysses' all-to-all."""
    kv_heads_per_gather: int | None = None
    """The strategies' ``kv_heads_per_gather``: with the all-gather, the key/value heads gathered per round
    (rounded down to a divisor of the model's ``Hkv``, as at run time); ``None``: every head at once."""
    cpu_offload: bool = False
    """FSDP only (``MegatronCPFSDPStrategy(cpu_offload=True)``): the parameters, gradients and AdamW state
    sharded in host memory, each unit gathered to the GPU for its forward and backward, the optimizer step
    on the host."""
    offload_layers: int | None = None
    """With ``offload``, how many decoder layers' inputs go to the host (the first ones; the later layers',
    back-propagated first, stay on the GPU): what the plan chooses where the host memory is the bound.
    ``None``: every layer's."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.cp < 1 or self.gpus % self.cp:
            raise ValueError(f"Layout: gpus={self.gpus} must be a positive multiple of cp={self.cp}.")
        if self.offload and not self.checkpointing:
            raise ValueError("Layout: offload moves the checkpointed layers' inputs; set checkpointing=True.")
        if self.offload_layers is not None and (not self.offload or self.offload_layers < 1):
            raise ValueError(
                f"Layout: offload_layers={self.offload_layers} needs offload=True and at least one layer."
            )
        if self.cpu_offload and not self.fsdp:
            raise ValueError("Layout: cpu_offload keeps FSDP's shards on the host; set fsdp=True.")
        try:
            self.mode()
        except ValueError as error:
            raise ValueError(f"Layout: {error}") from None

    def mode(self) -> AttentionMode:
        """The run-time attention mode of this layout's strategy arguments."""
        return AttentionMode(self.attention, self.kv_heads_per_gather)

    def gathered_kv_heads(self, kv_heads: int) -> int:
        """The key/value heads of one all-gather round for a model of ``kv_heads`` (all of them with every
        head at once), rounded as the run time rounds :attr:`kv_heads_per_gather`."""
        return self.mode().heads_per_gather(kv_heads, 0, None)

    def offloaded_layers(self, layers: int) -> int:
        """Of a model's ``layers``, how many have their inputs on the host (0 without offload)."""
        if not self.offload:
            return 0
        return layers if self.offload_layers is None else min(self.offload_layers, layers)

    @property
    def dp(self) -> int:
        return self.gpus // self.cp

    def name(self) -> str:
        """e.g. ``dp2 x cp4 FSDP +ckpt +offload +tiled`` (``+offload:29``: 29 layers' inputs on the host)."""
        extras = [
            flag
            for flag, on in (
                ("+ckpt", self.checkpointing),
                (
                    "+offload" if self.offload_layers is None else f"+offload:{self.offload_layers}",
                    self.offload,
                ),
                ("+tiled", self.tiled),
                ("+cpu_offload", self.cpu_offload),
            )
            if on
        ]
        attention = []
        if self.attention == "ulysses":
            attention = ["ulysses"]
        elif self.kv_heads_per_gather is not None:
            attention = [f"kv{self.kv_heads_per_gather}/gather"]
        return " ".join([f"dp{self.dp} x cp{self.cp}", "FSDP" if self.fsdp else "DDP", *attention, *extras])
