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

from lightning_cp.parallel.layout import heads_split

if TYPE_CHECKING:
    from lightning_cp.models.gpt import GPTConfig

Architecture = Literal["gpt", "hf"]
MixerKind = Literal["gated_deltanet", "kda", "mamba2", "short_conv"]


@dataclass(frozen=True)
class TokenMixer:
    """The layers of a hybrid model whose token mixer is not softmax attention, as the head-parallel exchange
    (:mod:`lightning_cp.hf.mixers`) runs them: how many, their kind, and their sizes.

    ``sizes`` by kind: Gated DeltaNet ``(key heads, value heads, key dim, value dim)``; KDA ``(heads, dim)``;
    Mamba2 ``(heads, head dim, groups, state size, chunk size)``; short convolution ``(channels,)``.
    """

    kind: MixerKind
    layers: int
    sizes: tuple[int, ...]

    def splits(self, cp: int) -> bool:
        """Whether the heads (or channels) split over ``cp`` ranks, as the adapters require
        (:func:`~lightning_cp.parallel.layout.heads_split`)."""
        if self.kind == "gated_deltanet":
            keys, values = self.sizes[:2]
            return heads_split(values, keys, cp)
        if self.kind == "mamba2":
            heads, groups = self.sizes[0], self.sizes[2]
            return heads_split(heads, groups, cp)
        return self.sizes[0] % cp == 0

    def saved_per_token(self, device: str) -> float:
        """Elements one layer's mixer keeps for backward per local token, in fp32.

        ``"cpu"``: what ``transformers``' torch kernels save, fitted to measurement within 2% (they cast to
        fp32 and keep every chunk's intermediates: hundreds of elements per head). ``"cuda"``: what the fused
        kernels (``fla``, ``mamba-ssm``, ``causal-conv1d``) keep by their design, not measured (no GPU has run
        them here): the convolution's input and output, the scan's inputs and output, the gated norm's gate,
        and one state per chunk of 64 tokens (``dk x dv`` per head), counted as fp32.
        """
        if device == "cpu":
            return self._torch_kernels_saved()
        if self.kind == "gated_deltanet":
            keys, values, key_dim, value_dim = self.sizes
            conv = 2 * keys * key_dim + values * value_dim
            return 2 * conv + values * (3 * value_dim + 2 + key_dim * value_dim / 64)
        if self.kind == "kda":
            heads, dim = self.sizes
            return 2 * 3 * heads * dim + heads * (4 * dim + 1 + dim * dim / 64)
        if self.kind == "mamba2":
            heads, dim, groups, state, chunk = self.sizes
            conv = heads * dim + 2 * groups * state
            return 2 * conv + heads * (3 * dim + 1 + dim * state / chunk)
        return 6.0 * self.sizes[0]

    def _torch_kernels_saved(self) -> float:
        if self.kind == "gated_deltanet":
            keys, values, key_dim, value_dim = self.sizes
            per_value_head = 11.65 * key_dim + 14.27 * value_dim + 318.4 - 0.47 * key_dim * value_dim / 64
            return 6.2 * keys * key_dim + values * per_value_head
        if self.kind == "kda":
            heads, dim = self.sizes
            return heads * (1509.0 + 224.5 * dim)
        if self.kind == "mamba2":
            heads, dim, groups, state, chunk = self.sizes
            per_head = 15.18 * dim + 4.51 * state + 3.17 * chunk + 5.5 * dim * state / chunk + 4.5
            return 73.0 + 7.55 * groups * state + heads * per_head
        return 9.0 * self.sizes[0] + 8.0

    def exchanged_per_token(self, cp: int) -> int:
        """Elements the two all-to-alls of one layer's forward send per local token (to the heads and back;
        heads read by several ranks sent to each)."""
        if self.kind == "gated_deltanet":
            keys, values, key_dim, value_dim = self.sizes
            return 2 * max(keys, cp) * key_dim + values * (2 * value_dim + 2)
        if self.kind == "kda":
            heads, dim = self.sizes
            return heads * (5 * dim + 1)
        if self.kind == "mamba2":
            heads, dim, groups, state, _ = self.sizes
            return heads * (2 * dim + 1) + 2 * max(groups, cp) * state
        return 2 * self.sizes[0]


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
    """Dimension of one head."""
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
        """Width of the keys (and of the values): ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (what one FSDP unit gathers): those outside the embedding and
        the LM head, over the layers."""
        embeddings = (1 if self.tied else 2) * self.vocab * self.hidden
        return (self.params - embeddings) // self.layers

    @classmethod
    def from_gpt_config(cls, config: GPTConfig) -> ModelShape:
        """The shape of :class:`~lightning_cp.models.GPT` built from ``config``."""
        import torch

        from lightning_cp.models.gpt import GPT

        with torch.device("meta"):
            params = sum(p.numel() for p in GPT(config).parameters())
        return cls(
            hidden=config.n_embd,
            layers=config.n_layer,
            heads=config.n_head,
            kv_heads=config.n_head,
            head_dim=config.n_embd // config.n_head,
            ffn=config.mlp_ratio * config.n_embd,
            vocab=config.vocab_size,
            tied=config.tie_embeddings,
            params=params,
            architecture="gpt",
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
        build). A multimodal composite's text model is planned.

        Raises:
            ValueError: no ``config.json`` in the directory, no ``model_type``, a model type ``transformers``
                does not know, a mixture of experts or a config without a gated MLP's sizes.
        """
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

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
        fields = {key: value for key, value in config.items() if key != "model_type"}
        try:
            hf = AutoConfig.for_model(config["model_type"], **fields)
        except ValueError as error:
            raise ValueError(f"model config: {str(error).splitlines()[0]}") from None
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
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(text)
        tied = getattr(text, "tie_word_embeddings", None)
        return cls(
            hidden=text.hidden_size,
            layers=text.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            ffn=ffn,
            vocab=text.vocab_size,
            tied=bool(getattr(hf, "tie_word_embeddings", False) if tied is None else tied),
            params=sum(p.numel() for p in model.parameters()),
            architecture="hf",
            mixer=_token_mixer(model),
            experts=experts,
            top_k=top_k,
            expert_ffn=expert_ffn,
        )


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
    from lightning_cp.hf.mixers import KINDS

    found = [m for m in model.modules() if type(m).__name__ in KINDS]
    if not found:
        return None
    first = found[0]
    kind = KINDS[type(first).__name__]
    if kind == "gated_deltanet":
        sizes = (first.num_k_heads, first.num_v_heads, first.head_k_dim, first.head_v_dim)
    elif kind == "kda":
        sizes = (first.num_heads, first.head_dim)
    elif kind == "mamba2":
        sizes = (first.num_heads, first.head_dim, first.n_groups, first.ssm_state_size, first.chunk_size)
    else:
        sizes = (first.conv.in_channels,)
    return TokenMixer(kind, len(found), sizes)
