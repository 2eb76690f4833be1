"""lightning-cp: context-parallel long-context LLM training for PyTorch Lightning.

Public API:

- :class:`MegatronCPStrategy` (also ``strategy="megatron_cp"``): DP x CP (x TP) training with Megatron-core groups,
  gradients averaged by DDP; :class:`MegatronCPFSDPStrategy` (``strategy="megatron_cp_fsdp"``) shards with FSDP2.
- :class:`CPLossMixin`: the CP-local fused LM loss for a ``LightningModule``, normalized over the global batch,
  and the policy losses of reinforcement learning (:class:`PolicyObjective`) from the same fused pass.
- :class:`MemoryProfilerCallback`: CUDA memory snapshots with offline reports on chosen steps and ranks.
- :mod:`lightning_cp.ops`: ``linear_cross_entropy``, ``cross_entropy``, ``token_logprobs``.
- :mod:`lightning_cp.parallel`: ``shard_batch``, ``unshard``, ``context_parallel_attention``.
- :mod:`lightning_cp.loss`: the mixin, the global-token normalization and torchmetrics over DP x CP.
- :mod:`lightning_cp.hf`: ``attn_implementation="lightning_cp"`` for Hugging Face ``transformers`` models,
  registered by this import when ``transformers`` is installed (without importing it), and their checks
  and loading registered into the strategies' setup (:mod:`lightning_cp.hf.integration`).
- :func:`load_pretrained`: a pretrained ``transformers`` causal LM in ``configure_model``, read shard by shard
  under :class:`MegatronCPFSDPStrategy`; :func:`export_hf`: a trained checkpoint back to a ``save_pretrained``
  directory (``lightning-cp export-hf``).
"""

from lightning_cp.callbacks import MemoryProfilerCallback
from lightning_cp.hf import registration as _hf_registration
from lightning_cp.hf.export import export_hf
from lightning_cp.hf.integration import TRANSFORMERS as _TRANSFORMERS
from lightning_cp.hf.loading import load_pretrained
from lightning_cp.loss import CPLossMixin, PolicyObjective
from lightning_cp.strategies import MegatronCPFSDPStrategy, MegatronCPStrategy, register_integration

__all__ = [
    "CPLossMixin",
    "MegatronCPFSDPStrategy",
    "MegatronCPStrategy",
    "MemoryProfilerCallback",
    "PolicyObjective",
    "export_hf",
    "load_pretrained",
]
__version__ = "0.1.0"

_hf_registration.install()  # attn_implementation="lightning_cp" into transformers
register_integration(_TRANSFORMERS)  # transformers models into the strategies' setup
