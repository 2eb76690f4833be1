"""What the memory plan needs to know of a model: its sizes, and how its layers save activations.

:class:`ModelShape` is built from a ``transformers`` config (a dict with ``model_type``, or a local
``save_pretrained`` directory's ``config.json``; no weights are read) or from the package GPT's
:class:`~lightning_cp.models.GPTConfig`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning_cp.hf.sparse_kinds import SparseIndexer, indexer_kind

if TYPE_CHECKING:
    from lightning_cp.hf.mixers.kinds import MixerKind, MixerShape
    from lightning_cp.models.gpt import GPTConfig

Architecture = Literal["gpt", "hf"]


@dataclass(frozen=True)
class TokenMixer:
    """The layers of a hybrid model whose token mixer is not softmax attention, as the head-parallel exchange
    (:mod:`lightning_cp.hf.mixers`) runs them: how many, and one layer's description (its kind, sizes, split
    rule and terms: :mod:`lightning_cp.hf.mixers.kinds`)."""

    shape: MixerShape
    layers: int

    @property
    def kind(self) -> MixerKind:
        """``gated_deltanet``, ``kda``, ``mamba2`` or ``short_conv``."""
        return self.shape.kind

    def splits(self, cp: int) -> bool:
        """Whether the heads (or channels) split over ``cp`` ranks, as the adapters require."""
        return self.shape.split_problem(cp) is None

    def saved_per_token(self, device: str) -> float:
        """Elements one layer's mixer keeps for backward per local token, in fp32
        (:meth:`~lightning_cp.hf.mixers.kinds.MixerShape.saved_per_token`)."""
        return self.shape.saved_per_token(device)

    def exchanged_per_token(self, cp: int) -> int:
        """Elements the two all-to-alls of one layer's forward send per local token
        (:meth:`~lightning_cp.hf.mixers.kinds.MixerShape.exchanged_per_token`)."""
        return self.shape.exchanged_per_token(cp)


@dataclass(frozen=True)
class LinearWeights:
    """The decoder's linear weights, counted on the ``meta`` build: every ``nn.Linear`` but the output layer's
    (what ``peft``'s ``target_modules="all-linear"`` adapts and QLoRA quantizes), and a mixture of experts'
    fused expert weights (``[experts, out, in]`` parameters, not ``nn.Linear``: neither adapted nor quantized,
    as ``torchao``'s ``to_nf4`` takes 2-D weights only)."""

    params: int
    """Elements of the ``nn.Linear`` weights."""
    dims: int
    """Their ``in_features + out_features``, summed: a LoRA of rank ``r`` adds ``r * dims`` parameters."""
    count: int
    """How many ``nn.Linear`` modules: each LoRA saves its ``[tokens, r]`` down-projection for the backward."""
    expert_params: int = 0
    """Elements of the fused expert weights."""
    expert_matrices: int = 0
    """Matrices among them (each expert's gate-up and down)."""
    largest: int = 0
    """Elements of the largest ``nn.Linear`` weight (the largest that QLoRA dequantizes)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only model, and which implementation's saved activations it has."""

    hidden: int
    """Model width ``d``."""
    layers: int
    """Decoder layers."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``heads``)."""
    head_dim: int
    """Dimension of one query and key head (multi-head latent attention: ``qk_nope + qk_rope``, the heads the
    attention receives)."""
    ffn: int
    """Width of the MLP's inner layer (of a mixture of experts: its shared experts', 0 without)."""
    vocab: int
    """Vocabulary size (embedding rows, LM-head outputs)."""
    tied: bool
    """The LM head is the embedding matrix."""
    params: int
    """Parameters, counted on a ``meta``-device build of the model (tied weights once)."""
    architecture: Architecture
    """``"gpt"``: the package GPT (fused QKV projection, GELU MLP); ``"hf"``: a ``transformers`` Llama-style
    decoder layer (separate Q, K, V projections, a gated MLP: SwiGLU or GeGLU)."""
    mixer: TokenMixer | None = None
    """A hybrid model's layers whose token mixer is not attention (the others are attention layers)."""
    experts: int = 0
    """A mixture of experts' routed experts per layer (0: a dense MLP)."""
    top_k: int = 0
    """Experts each token is routed to."""
    expert_ffn: int = 0
    """Width of one expert's inner layer."""
    qk_norm: bool = False
    """The attention normalizes its queries and keys (``q_norm`` / ``k_norm``: Qwen3, OLMo2, Gemma-3)."""
    layer_classes: tuple[str, ...] = ()
    """The decoder layers' class names (``_no_split_modules``): what ``activation_checkpointing`` names."""
    value_head_dim: int | None = None
    """Dimension of one value head where it differs from :attr:`head_dim` (multi-head latent attention's
    ``v_head_dim``); ``None``: :attr:`head_dim`."""
    latent_dim: int | None = None
    """Multi-head latent attention: the width of one token's latent and rotary key part (``kv_lora_rank +
    qk_rope_head_dim``, 576 for DeepSeek-V3), what CP exchanges per token of an attention layer instead of the
    expanded keys and values (:mod:`lightning_cp.hf.latent`); ``None``: not MLA."""
    kv_lora_rank: int | None = None
    """Multi-head latent attention: the latent's width without the rotary part (512 for DeepSeek-V3), the
    values of the absorbed form a sparse (DSA) layer attends in; ``None``: not MLA."""
    sparse: SparseIndexer | None = None
    """DeepSeek Sparse Attention's sizes, for a model whose attention reads only the keys an indexer selects
    (:class:`~lightning_cp.hf.sparse_kinds.SparseIndexer`)."""
    parameter_rows: tuple[tuple[int, int], ...] = ()
    """Each parameter's rows (its first dim, which FSDP2 shards) and elements per row, on the ``meta`` build;
    empty: not known (:meth:`pinned_shard_ratio` is then 1)."""
    linears: LinearWeights | None = None
    """The decoder's linear weights (what LoRA adapts and QLoRA quantizes); ``None``: not counted (a shape
    built by hand), which the plan refuses to plan LoRA for."""

    @property
    def mlp_width(self) -> int:
        """The MLP inner width one token's activations take: ``ffn``, plus ``top_k`` experts'."""
        return self.ffn + self.top_k * self.expert_ffn

    @property
    def attention_layers(self) -> int:
        """Layers whose token mixer is softmax attention."""
        return self.layers - (self.mixer.layers if self.mixer else 0)

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention output: ``heads * head_dim``."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the keys: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def v_head_dim(self) -> int:
        """Dimension of one value head (:attr:`value_head_dim`, else :attr:`head_dim`)."""
        return self.value_head_dim or self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of the values: ``kv_heads * v_head_dim``."""
        return self.kv_heads * self.v_head_dim

    @property
    def out_dim(self) -> int:
        """Width of the attention output: ``heads * v_head_dim``."""
        return self.heads * self.v_head_dim

    @property
    def dense_attention_layers(self) -> int:
        """Softmax attention layers that attend to every earlier key (the others are :attr:`sparse`)."""
        return self.attention_layers - (self.sparse.layers if self.sparse else 0)

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (what one FSDP unit gathers): those outside the embedding and
        the LM head, over the layers."""
        embeddings = (1 if self.tied else 2) * self.vocab * self.hidden
        return (self.params - embeddings) // self.layers

    def pinned_shard_ratio(self, ranks: int, itemsize: int) -> float:
        """Host bytes over exact bytes of every parameter's FSDP2 shard over ``ranks`` (``ceil(rows / ranks)``
        rows) of ``itemsize`` bytes per element, each pinned in its own block: under ``cpu_offload`` on CUDA the
        shards of the parameters and of their gradients are pinned one by one (FSDP2's ``CPUOffloadPolicy``),
        and PyTorch's caching host allocator rounds every pinned block up to a power of two (torch 2.13,
        ``CachingHostAllocatorImpl::allocate``). Llama-3-8B's is 1.10 (its MLP's fp32 weights of 224 MiB a shard
        on one rank take 256 MiB)."""
        exact = rounded = 0
        for rows, row in self.parameter_rows:
            nbytes = -(-rows // ranks) * row * itemsize
            exact += nbytes
            rounded += 1 << (nbytes - 1).bit_length() if nbytes else 0
        return rounded / exact if exact else 1.0

    @classmethod
    def from_gpt_config(cls, config: GPTConfig) -> ModelShape:
        """The shape of :class:`~lightning_cp.models.GPT` built from ``config``."""
        import torch

        from lightning_cp.models.gpt import GPT
        from lightning_cp.strategies import default_layer_classes

        with torch.device("meta"):
            model = GPT(config)
        return cls(
            hidden=config.n_embd,
            layers=config.n_layer,
            heads=config.n_head,
            kv_heads=config.n_head,
            head_dim=config.n_embd // config.n_head,
            ffn=config.mlp_ratio * config.n_embd,
            vocab=config.vocab_size,
            tied=config.tie_embeddings,
            params=sum(p.numel() for p in model.parameters()),
            architecture="gpt",
            layer_classes=default_layer_classes(model),
            linears=linear_weights(model, model.lm_head, experts=0),
            parameter_rows=parameter_rows(model),
        )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | Path) -> ModelShape:
        """The shape of a ``transformers`` Llama-style causal LM (Llama, Qwen2/3, Mistral, Gemma, ...).

        Args:
            config: a config dict with its ``model_type``, or a local directory with a ``config.json``
                (nothing is downloaded, no weights are read). ``transformers``' config class of the model
                type fills the defaults (``head_dim``, ``num_key_value_heads``, tying).

        A mixture of experts counts ``top_k`` experts' MLP per token in every layer (and its shared experts',
        ``ffn``); its parameters are counted exactly. A hybrid model's Gated DeltaNet, KDA, Mamba2 or
        short-convolution layers are :attr:`mixer` (the modules the package adapts, found on the ``meta``
        build). Multi-head latent attention (``qk_nope_head_dim``) is planned as the attention expands it:
        every query head with a key of ``qk_nope + qk_rope`` dims and a value of ``v_head_dim``, exchanged under
        CP as the latent (:attr:`latent_dim` per token); DeepSeek
        Sparse Attention as :attr:`sparse`, sized as the family of the indexers found on the ``meta`` build
        describes it (:mod:`lightning_cp.hf.sparse_kinds`). A multimodal composite's text model is planned.

        Raises:
            ValueError: no ``config.json`` in the directory, no ``model_type``, or a config ``HFCausalLM``
                refuses (:func:`~lightning_cp.hf.loading.check_causal_lm_config`: a model type
                ``transformers`` does not know, with the closest known ones, or one without a causal-LM
                class), a mixture of experts or a config without a gated MLP's sizes.
        """
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from lightning_cp.hf.loading import check_causal_lm_config
        from lightning_cp.strategies import default_layer_classes

        if not isinstance(config, Mapping):
            path = Path(config) / "config.json"
            if not path.is_file():
                raise ValueError(
                    f"model {str(config)!r}: no config.json there; give a save_pretrained directory."
                )
            config = json.loads(path.read_text())
        if "model_type" not in config:
            raise ValueError(
                "model config: no 'model_type'; add the transformers model type, e.g. \"llama\"."
            )
        # HFCausalLM's own check, before transformers lists every model type it knows in one line.
        check_causal_lm_config(config)
        hf = AutoConfig.for_model(**config)
        text = hf.get_text_config()
        missing = [
            key
            for key in ("hidden_size", "num_hidden_layers", "num_attention_heads")
            if not isinstance(getattr(text, key, None), int)
        ]
        experts, top_k, expert_ffn, ffn = _mlp_sizes(text)
        if ffn is None:
            missing.append("intermediate_size")
        if missing:
            raise ValueError(
                f"model config ({text.model_type}): no {', '.join(missing)}; the plan needs them."
            )
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        value_head_dim = latent_dim = kv_lora_rank = None
        if getattr(text, "qk_nope_head_dim", None):  # MLA: the latent exchanged, expanded to every query head
            head_dim, kv_heads = text.qk_nope_head_dim + text.qk_rope_head_dim, heads
            value_head_dim = text.v_head_dim
            rank = getattr(text, "kv_lora_rank", None)
            latent_dim = rank + text.qk_rope_head_dim if rank else None
            kv_lora_rank = rank or None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text)
        tied = getattr(text, "tie_word_embeddings", None)
        return cls(
            hidden=text.hidden_size,
            layers=text.num_hidden_layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            ffn=ffn,
            vocab=text.vocab_size,
            tied=bool(getattr(hf, "tie_word_embeddings", False) if tied is None else tied),
            params=sum(p.numel() for p in model.parameters()),
            architecture="hf",
            mixer=_token_mixer(model),
            experts=experts,
            top_k=top_k,
            expert_ffn=expert_ffn,
            qk_norm=any(name.rsplit(".", 1)[-1] == "q_norm" for name, _ in model.named_modules()),
            layer_classes=default_layer_classes(model),
            value_head_dim=value_head_dim,
            latent_dim=latent_dim,
            kv_lora_rank=kv_lora_rank,
            sparse=_sparse_indexer(model, text),
            linears=linear_weights(model, model.get_output_embeddings(), experts),
            parameter_rows=parameter_rows(model),
        )


def parameter_rows(model: Any) -> tuple[tuple[int, int], ...]:
    """:attr:`ModelShape.parameter_rows` of ``model`` (a ``meta`` build; tied weights once)."""
    return tuple((p.shape[0], p[0].numel()) if p.dim() else (1, 1) for p in model.parameters())


def linear_weights(model: Any, output: Any, experts: int) -> LinearWeights:
    """The :class:`LinearWeights` of ``model`` (a ``meta`` build): its ``nn.Linear`` modules but ``output``
    (the LM head), and its ``[experts, out, in]`` parameters when it has ``experts`` routed experts."""
    from torch import nn

    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not output]
    fused = [p for p in model.parameters() if experts and p.dim() == 3 and p.shape[0] == experts]
    return LinearWeights(
        params=sum(m.weight.numel() for m in linears),
        dims=sum(m.in_features + m.out_features for m in linears),
        count=len(linears),
        expert_params=sum(p.numel() for p in fused),
        expert_matrices=sum(p.shape[0] for p in fused),
        largest=max((m.weight.numel() for m in linears), default=0),
    )


def _sparse_indexer(model: Any, text: Any) -> SparseIndexer | None:
    """The DeepSeek Sparse Attention sizes of ``model`` (a ``meta`` build of the config ``text``) as its indexers'
    family describes them (:meth:`~lightning_cp.hf.sparse_kinds.IndexerKind.sizes`), or ``None`` without an
    indexer the package adapts."""
    kind = next(filter(None, map(indexer_kind, model.modules())), None)
    return None if kind is None else kind.sizes(text)


def _mlp_sizes(text: Any) -> tuple[int, int, int, int | None]:
    """``(experts, top_k, expert_ffn, ffn)``: a dense MLP's ``(0, 0, 0, intermediate_size)``, or a mixture of
    experts' routed experts, experts per token, an expert's width and its shared experts' width (0 without)."""
    experts = next(
        (
            getattr(text, k)
            for k in ("num_experts", "num_local_experts", "n_routed_experts")
            if getattr(text, k, None)
        ),
        0,
    )
    if not experts:
        ffn = getattr(text, "intermediate_size", None)
        return 0, 0, 0, ffn if isinstance(ffn, int) else None
    top_k = next(
        getattr(text, k)
        for k in ("num_experts_per_tok", "num_experts_per_token", "moe_topk")
        if getattr(text, k, None)
    )
    width = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", None)
    shared = (getattr(text, "shared_expert_intermediate_size", None) or 0) + (
        getattr(text, "n_shared_experts", None) or 0
    ) * width
    return experts, top_k, width, shared


def _token_mixer(model: Any) -> TokenMixer | None:
    """The layers of ``model`` (a ``meta`` build) whose mixer the package adapts, as a :class:`TokenMixer`."""
    from lightning_cp.hf.mixers import mixer_shape

    shapes = [shape for shape in map(mixer_shape, model.modules()) if shape is not None]
    return TokenMixer(shapes[0], len(shapes)) if shapes else None
