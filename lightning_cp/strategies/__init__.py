from lightning_cp.strategies.checkpoint_io import AtomicCheckpointIO
from lightning_cp.strategies.megatron_cp import MegatronCPStrategy, consolidate_checkpoint
from lightning_cp.strategies.preemption import PreemptionCheckpoint

__all__ = ["AtomicCheckpointIO", "MegatronCPStrategy", "PreemptionCheckpoint", "consolidate_checkpoint"]
