"""The seam through which a model library plugs into the strategies' setup, without the strategies knowing it.

A :class:`ModelIntegration` answers, for the models of its library inside a ``LightningModule``, what the
strategies ask at fixed points of ``setup``: refuse what CP cannot train exactly (static checks before
wrapping, a behavioural probe on weights), prepare the models for the batch's shard (layers that need a
context-parallel forward of their own, guards on calls), build pretrained models on the
``meta`` device and fill them after FSDP has sharded them. The strategies call every registered
integration at those points; the package registers its ``transformers`` integration
(:mod:`lightning_cp.hf.integration`) when it is imported, as its attention registers into
``transformers``. Another library (a model zoo of your own) registers the same way::

    from lightning_cp.strategies import register_integration
    register_integration(MyIntegration())

Setup, in order (``MegatronCPStrategy`` / ``MegatronCPFSDPStrategy``):

1. ``configure_model`` runs inside every integration's :meth:`~ModelIntegration.loading_context` (FSDP only);
2. :meth:`~ModelIntegration.check`, then :meth:`~ModelIntegration.prepare`, on the unwrapped module (every
   rank, no weights needed);
3. DDP: :meth:`~ModelIntegration.probe` on the whole module; FSDP: ``fully_shard``, then
   :meth:`~ModelIntegration.materialize`, then :meth:`~ModelIntegration.probe` inside the FSDP root's
   forward, for modules where :meth:`~ModelIntegration.holds_models`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from lightning_cp.parallel.layout import ParallelLayout


class ModelIntegration(Protocol):
    """What a model library gives the strategies. Every method is called on every rank with the same module."""

    def check(self, module: nn.Module, layout: ParallelLayout) -> None:
        """Refuse what needs no weights to refuse (configs, attention classes), before any wrapping.

        Raises:
            ValueError: naming the model, what it does and what to change.
        """

    def holds_models(self, module: nn.Module) -> bool:
        """Whether ``module`` holds models of this library (what :meth:`probe` would look at)."""

    def probe(self, module: nn.Module, layout: ParallelLayout, device: torch.device) -> None:
        """Refuse, from what the models compute, any whose training under ``layout`` could differ from the
        unsharded model's. The models are whole (DDP; moved to ``device`` here) or sharded by FSDP2, in which
        case this runs inside the FSDP root's forward. May run collectives over ``layout``'s groups.

        Raises:
            ValueError: naming the model, the module that differs and what to change.
        """

    def prepare(self, module: nn.Module, layout: ParallelLayout) -> None:
        """Make the models ready for the batch's shard (after :meth:`check`, before :meth:`probe`): layers that
        need a context-parallel forward of their own get it, and a call on a shard that would see only this
        rank's tokens is refused.

        Raises:
            ValueError: a layer that cannot be split over ``layout.cp`` ranks, naming it and the numbers.
        """

    def loading_context(self) -> AbstractContextManager[None]:
        """Entered around ``configure_model`` under FSDP: pretrained models may be built on ``meta``."""

    def materialize(self, module: nn.Module, device: torch.device) -> None:
        """After ``fully_shard``: allocate on ``device`` and read the local shards of what
        :meth:`loading_context` left on ``meta`` (a no-op without such models). ``device`` is where the
        parameters live: the host under ``cpu_offload``; the strategy moves the buffers to the compute device
        after it."""


_REGISTERED: list[ModelIntegration] = []


def register_integration(integration: ModelIntegration) -> None:
    """Make the strategies call ``integration`` at setup (once; registering it again changes nothing)."""
    if integration not in _REGISTERED:
        _REGISTERED.append(integration)


def integrations() -> tuple[ModelIntegration, ...]:
    """The registered integrations, in registration order."""
    return tuple(_REGISTERED)
