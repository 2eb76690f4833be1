"""What ``lightning-cp fit | validate | test | predict`` refuses from the configuration before any rank starts.

The classes are built by then, but no process group exists and no weights are read: what is checked here
follows from the model's config (a ``GPTConfig``, a ``transformers`` config dict, or the ``config.json`` of a
pretrained directory), its policy objective, the data module's vocabulary, validation file and rollout
columns, and the strategy's arguments. Without it, each of these mistakes would start every rank and end in
hundreds of lines from each: a token id the embedding cannot take (``IndexError``), the setup's refusal of a
model that CP cannot train as configured, or a KL term without reference log-probs (at the first step, or
in the sanity check); or it would end with status 0 having done nothing (``validate`` without a validation
file).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.strategies import Strategy

from lightning_cp.constants import REF_LOGPROBS
from lightning_cp.data import RolloutDataModule
from lightning_cp.hf.integration import check_before_launch as check_hf_model
from lightning_cp.hf.loading import causal_lm_config
from lightning_cp.loss.policy import PolicyObjective
from lightning_cp.models import HFCausalLM
from lightning_cp.strategies import MegatronCPBase

_EVALUATIONS = ("validate", "test")
"""The subcommands that run on the validation data alone (``RolloutDataModule``'s ``val_path``)."""


def check_before_launch(
    model: LightningModule,
    datamodule: LightningDataModule | None,
    strategy: Strategy,
    subcommand: str = "fit",
) -> None:
    """Refuse a data vocabulary larger than the model's; (``HFCausalLM`` under a lightning-cp strategy) what
    the strategy's setup would refuse of the ``transformers`` model from its config alone
    (:func:`lightning_cp.hf.integration.check_before_launch`: attention that cannot reach the other ranks,
    Mamba1, token mixers or Ulysses' heads that do not split over ``cp``); and, for a ``RolloutDataModule``,
    ``validate`` / ``test`` without ``val_path``, or a model's ``objective`` with ``kl_coef > 0`` on rollouts
    that the ``subcommand`` reads without ``ref_logprobs`` (``fit``: ``path`` and ``val_path``; ``validate``
    / ``test``: ``val_path``; ``predict`` computes no loss), unless the model has LoRA adapters (its base is
    the reference, computed in the step).

    Raises:
        ValueError: naming the setting, the numbers and what to change (the CLI prints it as one line).
    """
    config = model.hparams.get("config")  # GPTModule's GPTConfig, HFCausalLM's config dict or directory, ...
    _check_vocabularies(_vocab_size(model, config), config, datamodule)
    if isinstance(model, HFCausalLM) and isinstance(strategy, MegatronCPBase):
        check_hf_model(config, strategy.cp, strategy.attention_mode)
    if isinstance(datamodule, RolloutDataModule):
        # With LoRA the reference is the base model, adapters off, computed in the step.
        in_step = getattr(model, "lora", None) is not None
        _check_rollouts(getattr(model, "objective", None), datamodule, subcommand, in_step)


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


def _check_rollouts(objective: object, data: RolloutDataModule, subcommand: str, in_step: bool) -> None:
    """``validate`` / ``test`` with no validation rollouts, and a KL term without the reference log-probs of
    the rollouts the subcommand reads (their columns or directories) unless the model computes them in the
    step (``in_step``: LoRA's base model)."""
    if subcommand in _EVALUATIONS and data.val_path is None:
        raise ValueError(
            f"data.val_path is not set: {subcommand} runs on RolloutDataModule's validation rollouts only "
            f"(path is the training data), so it would {subcommand} nothing; set data.init_args.val_path to a "
            "rollout file."
        )
    if (
        not isinstance(objective, PolicyObjective)
        or objective.kl_coef == 0
        or subcommand == "predict"
        or in_step
    ):
        return
    for name in ("val_path",) if subcommand in _EVALUATIONS else ("path", "val_path"):
        keys = data.logprob_keys(name)
        if keys is None or REF_LOGPROBS in keys:
            continue
        file = data.path if name == "path" else data.val_path
        fix = (
            "set data.init_args.ref_logprobs to the directory lightning-cp predict wrote with the reference "
            "weights, or give the file a 'ref_logprobs' column"
            if name == "path"
            else "give the file a 'ref_logprobs' column (a validation file's log-probs come from its own "
            "columns), or leave val_path unset"
        )
        raise ValueError(
            f"model.objective.kl_coef={objective.kl_coef} needs the reference model's log-probs of every "
            f"rollout, which data.{name}={file!r} does not give ({subcommand} reads it): {fix}; or set "
            "kl_coef: 0."
        )
