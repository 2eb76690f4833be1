"""The memory plan: which layouts fit a model and a sequence length on a number of GPUs.

Pure arithmetic over a :class:`ModelShape` (no model is built but on the ``meta`` device); the terms and
what they were measured against are in docs/design.md, "Memory plan". ``lightning-cp plan`` prints it.
"""

from lightning_cp.plan.activations import Precision, local_tokens, saved_per_token
from lightning_cp.plan.layout import Layout
from lightning_cp.plan.memory import MemoryEstimate, estimate
from lightning_cp.plan.search import Candidate, layouts, max_seq_len, plan
from lightning_cp.plan.shape import ModelShape

__all__ = [
    "Candidate",
    "Layout",
    "MemoryEstimate",
    "ModelShape",
    "Precision",
    "estimate",
    "layouts",
    "local_tokens",
    "max_seq_len",
    "plan",
    "saved_per_token",
]
