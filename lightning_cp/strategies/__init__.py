from lightning_cp.strategies.megatron_cp import MegatronCPStrategy, consolidate_checkpoint

__all__ = ["MegatronCPStrategy", "consolidate_checkpoint"]
