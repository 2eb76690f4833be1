"""``transformers`` models in the strategies' setup: the package's model integration.

The strategies know no model library; they call the integrations registered with them
(:mod:`lightning_cp.strategies.integrations`) at fixed points of ``setup``. This is the one for
``transformers``, registered by ``import lightning_cp``: the static checks and the behavioural probe of
:mod:`lightning_cp.hf.probe`, the guard on calls with a batch's shard (:mod:`lightning_cp.hf.attention`), and
pretrained models built on ``meta`` and read shard by shard under FSDP (:mod:`lightning_cp.hf.loading`).
It duck-types :class:`~lightning_cp.strategies.integrations.ModelIntegration` (``hf`` never imports the
strategies).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lightning_cp.constants import ATTN_IMPLEMENTATION
from lightning_cp.hf.indexers import adapt_indexers
from lightning_cp.hf.latent import adapt_latent_attention
from lightning_cp.hf.loading import causal_lm_config, deferred_loading, materialize_pretrained
from lightning_cp.hf.lora import materialize_adapters
from lightning_cp.hf.mixers import adapt_token_mixers
from lightning_cp.hf.probe import check_configs, holds_transformers_models, probe_models, transformers_models
from lightning_cp.hf.registration import UnsupportedAttentionClasses
from lightning_cp.hf.sharded_calls import guard_sharded_calls
from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.parallel.layout import ParallelLayout


def check_before_launch(config: Mapping[str, Any] | str, cp: int, attention: AttentionMode) -> None:
    """The setup's checks that need no weights, run on the causal LM that ``config`` builds (a config dict, or a
    ``save_pretrained`` directory of which only ``config.json`` is read) before any rank starts, so that a
    launcher (``lightning-cp fit``) refuses in one line what every rank's setup would refuse: the model built on
    the ``meta`` device as ``HFCausalLM`` builds it, :func:`~lightning_cp.hf.probe.check_configs` for ``cp``
    ranks per sequence (attention classes, configs, Mamba1, token mixers whose heads do not split), and under
    ``attention``'s Ulysses the config's query and key/value heads split over ``cp``.

    Raises:
        ValueError: naming the model (``model (<class>)``, as the setup names ``HFCausalLM.model``), what CP
            cannot do with it, the numbers and what to change.
    """
    from transformers import AutoModelForCausalLM

    text = causal_lm_config(config)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(text, attn_implementation=ATTN_IMPLEMENTATION)
        except UnsupportedAttentionClasses:  # the family's own attention, as HFCausalLM builds it
            model = AutoModelForCausalLM.from_config(text, attn_implementation=None)
    check_configs(nn.ModuleDict({"model": model}), cp)
    values = text.to_dict()  # a per-layer (heterogeneous) config refuses attribute access to the head counts
    heads = values.get("num_attention_heads")
    kv_heads = values.get("num_key_value_heads") or heads
    if cp > 1 and isinstance(heads, int) and isinstance(kv_heads, int):
        try:
            attention.ulysses(heads, kv_heads, cp)
        except ValueError as error:
            raise ValueError(f"model ({type(model).__name__}): {error}") from None


def prepare_models(module: nn.Module, layout: ParallelLayout) -> None:
    """Every ``transformers`` model in ``module`` ready for the batch's shard: ``peft`` adapters of a ``meta``
    build allocated and initialized (:func:`~lightning_cp.hf.lora.materialize_adapters`), its token mixers that are not
    softmax attention get their context-parallel forward (:func:`~lightning_cp.hf.mixers.adapt_token_mixers`,
    at every CP size: they also keep packed documents apart), so do its sparse-attention indexers
    (:func:`~lightning_cp.hf.indexers.adapt_indexers`), its multi-head latent attention layers hand the
    attention their latent unexpanded (:func:`~lightning_cp.hf.latent.adapt_latent_attention`), and under
    ``cp > 1`` a call on a shard without
    the batch's ``cp_shard`` is refused (:func:`~lightning_cp.hf.attention.guard_sharded_calls`). No
    communication.

    Raises:
        ValueError: a mixer whose heads do not split over ``layout.cp`` ranks, naming it and the numbers.
    """
    materialize_adapters(module)
    for where, model in transformers_models(module):
        try:
            adapt_token_mixers(model, layout.cp)
        except ValueError as error:
            raise ValueError(f"{where} ({type(model).__name__}): {error}") from None
        adapt_indexers(model)
        adapt_latent_attention(model)
    if layout.cp > 1:
        guard_sharded_calls(module)


class TransformersIntegration:
    """The ``transformers`` models of a ``LightningModule`` (a causal LM, a teacher) at the strategies' setup."""

    def check(self, module: nn.Module, layout: ParallelLayout) -> None:
        """:func:`~lightning_cp.hf.probe.check_configs`: attention classes and configs CP would change."""
        check_configs(module, layout.cp)

    def holds_models(self, module: nn.Module) -> bool:
        """Whether ``module`` holds a ``transformers`` model."""
        return holds_transformers_models(module)

    def probe(self, module: nn.Module, layout: ParallelLayout, device: torch.device) -> None:
        """:func:`~lightning_cp.hf.probe.probe_models`: every model sharded vs whole, module by module."""
        probe_models(module, layout, device)

    def prepare(self, module: nn.Module, layout: ParallelLayout) -> None:
        """:func:`prepare_models`: token mixers adapted, calls on a shard guarded."""
        prepare_models(module, layout)

    def loading_context(self) -> AbstractContextManager[None]:
        """:func:`~lightning_cp.hf.loading.deferred_loading`: ``load_pretrained`` builds on ``meta``."""
        return deferred_loading()

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """:func:`~lightning_cp.hf.loading.materialize_pretrained`: each rank reads its own shards."""
        materialize_pretrained(module, device)


TRANSFORMERS = TransformersIntegration()
"""The instance ``import lightning_cp`` registers with the strategies."""


def check_models(module: nn.Module, layout: ParallelLayout, device: torch.device) -> None:
    """The ``transformers`` integration's setup steps in one call, for a module every rank holds whole, outside
    a strategy (a script of your own, a test): :meth:`TransformersIntegration.check`,
    :meth:`~TransformersIntegration.prepare`, then :meth:`~TransformersIntegration.probe` on ``device``, in
    the order ``MegatronCPStrategy``'s setup calls them through the integration seam
    (:mod:`lightning_cp.strategies.integrations`; the strategies call those methods, not this). Refuses,
    before the first step, anything in ``module`` whose training under ``layout`` could differ from the
    unsharded model's, and leaves its models ready for the batch's shard.

    Every rank of the CP group must call this with the same module (the probe's collectives).

    Raises:
        ValueError: naming the model, the module or config attribute, and what to change.
    """
    TRANSFORMERS.check(module, layout)
    TRANSFORMERS.prepare(module, layout)
    TRANSFORMERS.probe(module, layout, device)
