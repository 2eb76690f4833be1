from lightning_cp.strategies.megatron_cp import MegatronCPStrategy

__all__ = ["MegatronCPStrategy"]
