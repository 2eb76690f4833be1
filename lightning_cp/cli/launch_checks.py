"""What ``lightning-cp fit | validate | test | predict`` refuses from the configuration before any rank starts.

The classes are built by then, but no process group exists and no weights are read: what is checked here
follows from the model's config (a ``GPTConfig``, a ``transformers`` config dict, or the ``config.json`` of a
pretrained directory), the data module's vocabulary and the strategy's arguments. Without it, each of these
mistakes would start every rank and end in hundreds of lines from each: a token id the embedding cannot take
(``IndexError``), or the setup's refusal of a model that CP cannot train as configured.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.strategies import Strategy

from lightning_cp.hf.integration import check_before_launch as check_hf_model
from lightning_cp.hf.loading import causal_lm_config
from lightning_cp.models import HFCausalLM
from lightning_cp.strategies import MegatronCPBase


def check_before_launch(
    model: LightningModule, datamodule: LightningDataModule | None, strategy: Strategy
) -> None:
    """Refuse a data vocabulary larger than the model's, and (``HFCausalLM`` under a lightning-cp strategy)
    what the strategy's setup would refuse of the ``transformers`` model from its config alone
    (:func:`lightning_cp.hf.integration.check_before_launch`: attention that cannot reach the other ranks,
    Mamba1, token mixers or Ulysses' heads that do not split over ``cp``).

    Raises:
        ValueError: naming the setting, the numbers and what to change (the CLI prints it as one line).
    """
    config = model.hparams.get("config")  # GPTModule's GPTConfig, HFCausalLM's config dict or directory, ...
    _check_vocabularies(_vocab_size(model, config), config, datamodule)
    if isinstance(model, HFCausalLM) and isinstance(strategy, MegatronCPBase):
        check_hf_model(config, strategy.cp, strategy.attention_mode)


def _vocab_size(model: LightningModule, config: Any) -> int | None:
    if isinstance(model, HFCausalLM):
        return causal_lm_config(config).vocab_size
    vocab = config.get("vocab_size") if isinstance(config, dict) else getattr(config, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _check_vocabularies(model_vocab: int | None, config: Any, datamodule: LightningDataModule | None) -> None:
    """A data vocabulary (the tokenizer's, or the ids a token file declares) larger than the model's fails here,
    not as an ``IndexError`` in the embedding."""
    data_vocab = getattr(datamodule, "vocab_size", None)
    if model_vocab is None or not isinstance(data_vocab, int) or data_vocab <= model_vocab:
        return
    fix = (
        f"The model is the pretrained {config!r} (its config.json): use the tokenizer and data of that model, "
        f"or resize its embeddings (model.resize_token_embeddings({data_vocab}); save_pretrained) and train "
        "that directory."
        if isinstance(config, str)  # a pretrained directory: its embeddings have their size
        else f"Set the model's vocab_size to at least {data_vocab}."
    )
    raise ValueError(
        f"data.vocab_size={data_vocab} is larger than the model's vocab_size={model_vocab}: token ids up to "
        f"{data_vocab - 1} cannot be embedded. {fix}"
    )
