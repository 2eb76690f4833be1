"""CP-local chunked loss kernels: the LM-head cross-entropy without ``[tokens, vocab]`` logits.

No Lightning imports here: the strategy, mixins and metrics build on these functions.
"""

from lightning_cp.ops._stats import TokenStats
from lightning_cp.ops.cross_entropy import cross_entropy, linear_cross_entropy, token_logprobs

__all__ = ["TokenStats", "cross_entropy", "linear_cross_entropy", "token_logprobs"]
