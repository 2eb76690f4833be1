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

if TYPE_CHECKING:
    from lightning_cp.models.gpt import GPTConfig

Architecture = Literal["gpt", "hf"]


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
    """Width of the MLP's inner layer."""
    vocab: int
    """Vocabulary size (embedding rows, LM-head outputs)."""
    tied: bool
    """The LM head is the embedding matrix."""
    params: int
    """Parameters, counted on a ``meta``-device build of the model (tied weights once)."""
    architecture: Architecture
    """``"gpt"``: the package GPT (fused QKV projection, GELU MLP); ``"hf"``: a ``transformers`` Llama-style
    decoder layer (separate Q, K, V projections, a gated MLP: SwiGLU or GeGLU)."""

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
        experts = [
            k for k in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(text, k, None)
        ]
        if experts:
            raise ValueError(
                f"model config: a mixture of experts ({experts[0]}={getattr(text, experts[0])}); the plan counts "
                "dense Llama-style layers only."
            )
        missing = [
            key
            for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
            if not isinstance(getattr(text, key, None), int)
        ]
        if missing:
            raise ValueError(
                f"model config ({text.model_type}): no {', '.join(missing)}; the plan needs them."
            )
        heads = text.num_attention_heads
        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
        return cls(
            hidden=text.hidden_size,
            layers=text.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            ffn=text.intermediate_size,
            vocab=text.vocab_size,
            tied=bool(getattr(hf, "tie_word_embeddings", False)),
            params=params,
            architecture="hf",
        )
