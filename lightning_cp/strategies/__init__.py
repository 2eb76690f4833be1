"""The package's Lightning strategies, one per way of wrapping the model, and what they share.

- :class:`MegatronCPStrategy` (``strategy="megatron_cp"``): DDP over the DP x CP ranks.
- :class:`MegatronCPFSDPStrategy` (``strategy="megatron_cp_fsdp"``): FSDP2 over the DP x CP ranks.
- :class:`MegatronCPBase`: what both do (Megatron-core groups, layout, sampling, batch sharding, SIGTERM).
- :class:`AtomicCheckpointIO`, :func:`consolidate_checkpoint`, :class:`PreemptionCheckpoint`: checkpoints.
- :func:`default_layer_classes`: the layer classes of a model the strategies take by default (FSDP's units).
- :func:`register_integration`: how a model library (the package's ``transformers`` support) plugs into
  the strategies' setup (:mod:`lightning_cp.strategies.integrations`).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_cp.checkpoint_format import consolidate_checkpoint
from lightning_cp.strategies._modules import default_layer_classes
from lightning_cp.strategies.base import MegatronCPBase
from lightning_cp.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_cp.strategies.integrations import ModelIntegration, register_integration
from lightning_cp.strategies.megatron_cp import MegatronCPStrategy
from lightning_cp.strategies.megatron_cp_fsdp import MegatronCPFSDPStrategy
from lightning_cp.strategies.preemption import PreemptionCheckpoint

__all__ = [
    "AtomicCheckpointIO",
    "MegatronCPBase",
    "MegatronCPFSDPStrategy",
    "MegatronCPStrategy",
    "ModelIntegration",
    "PreemptionCheckpoint",
    "consolidate_checkpoint",
    "default_layer_classes",
    "register_integration",
]

for _strategy in (MegatronCPStrategy, MegatronCPFSDPStrategy):
    if _strategy.strategy_name not in StrategyRegistry:
        _strategy.register_strategies(StrategyRegistry)
