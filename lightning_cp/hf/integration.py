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

from contextlib import AbstractContextManager

import torch
from torch import nn

from lightning_cp.hf.attention import guard_sharded_calls
from lightning_cp.hf.loading import deferred_loading, materialize_pretrained
from lightning_cp.hf.probe import check_configs, holds_transformers_models, probe_models
from lightning_cp.parallel.layout import ParallelLayout


class TransformersIntegration:
    """The ``transformers`` models of a ``LightningModule`` (a causal LM, a teacher) at the strategies' setup."""

    def check(self, module: nn.Module, layout: ParallelLayout) -> None:
        """:func:`~lightning_cp.hf.probe.check_configs`: attention classes and configs CP would change."""
        check_configs(module, layout)

    def holds_models(self, module: nn.Module) -> bool:
        """Whether ``module`` holds a ``transformers`` model."""
        return holds_transformers_models(module)

    def probe(self, module: nn.Module, layout: ParallelLayout, device: torch.device) -> None:
        """:func:`~lightning_cp.hf.probe.probe_models`: every model sharded vs whole, module by module."""
        probe_models(module, layout, device)

    def guard_calls(self, module: nn.Module) -> None:
        """:func:`~lightning_cp.hf.attention.guard_sharded_calls` on every ``transformers`` model."""
        guard_sharded_calls(module)

    def loading_context(self) -> AbstractContextManager[None]:
        """:func:`~lightning_cp.hf.loading.deferred_loading`: ``load_pretrained`` builds on ``meta``."""
        return deferred_loading()

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """:func:`~lightning_cp.hf.loading.materialize_pretrained`: each rank reads its own shards."""
        materialize_pretrained(module, device)


TRANSFORMERS = TransformersIntegration()
"""The instance ``import lightning_cp`` registers with the strategies."""
