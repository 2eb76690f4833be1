"""Lightning callbacks that work in any Lightning project, with or without ``MegatronCPStrategy``."""

from lightning_cp.callbacks.logprob_writer import TokenLogprobWriter
from lightning_cp.callbacks.memory_profiler import MemoryProfilerCallback
from lightning_cp.callbacks.rollout_logprob_writer import RolloutLogprobWriter

__all__ = ["MemoryProfilerCallback", "RolloutLogprobWriter", "TokenLogprobWriter"]
