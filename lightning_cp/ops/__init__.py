"""CP-local chunked loss kernels: the LM-head cross-entropy without ``[tokens, vocab]`` logits.

Each function comes plain and with its per-token byproducts: :func:`linear_cross_entropy` /
:func:`linear_cross_entropy_with_stats`, :func:`cross_entropy` / :func:`cross_entropy_with_stats`
(:class:`TokenStats`), :func:`token_logprobs` / :func:`token_logprobs_with_entropy`; their keyword
options are :class:`LossOptions` and :class:`LogprobOptions`. :class:`OutputHead` bundles an LM head
(weight, bias, logit scale, final softcap) for :class:`~lightning_cp.CPLossMixin`.

No Lightning imports here: the strategy, mixins and metrics build on these functions.
"""

from lightning_cp.ops.cross_entropy import (
    HeadOptions,
    LogprobOptions,
    LossOptions,
    cross_entropy,
    cross_entropy_with_stats,
    linear_cross_entropy,
    linear_cross_entropy_with_stats,
    token_logprobs,
    token_logprobs_with_entropy,
)
from lightning_cp.ops.output_head import OutputHead
from lightning_cp.ops.token_stats import TokenStats

__all__ = [
    "HeadOptions",
    "LogprobOptions",
    "LossOptions",
    "OutputHead",
    "TokenStats",
    "cross_entropy",
    "cross_entropy_with_stats",
    "linear_cross_entropy",
    "linear_cross_entropy_with_stats",
    "token_logprobs",
    "token_logprobs_with_entropy",
]
