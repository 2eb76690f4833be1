"""The CP-local language-model loss of a ``LightningModule``: the mixin, its normalization, its metrics.

- :class:`CPLossMixin` (:mod:`~lightning_cp.loss.mixin`): ``lm_loss`` / ``lm_loss_from_logits`` /
  ``lm_token_logprobs`` on this rank's tokens, through the fused head of :mod:`lightning_cp.ops`.
- :class:`PolicyObjective` (:mod:`~lightning_cp.loss.policy`): the policy-gradient objectives of
  reinforcement learning (PPO / GRPO / GSPO / Dr. GRPO) that ``CPLossMixin.policy_loss`` trains; their
  per-token losses and aggregations by name (:func:`register_policy_loss`, :func:`register_aggregation`,
  :mod:`~lightning_cp.loss.policy_registry`).
- :class:`GlobalTokenObjective` (:mod:`~lightning_cp.loss.objective`): the one place the loss is
  normalized into the mean over the global batch's target tokens.
- :mod:`~lightning_cp.loss.metrics`: torchmetrics aggregators over DP x CP (sums and counts), the same
  numbers for every CP size; :mod:`~lightning_cp.loss.lm_metrics`: which of them the mixin logs and how
  they are fed from the loss pass.
"""

from lightning_cp.loss.metrics import (
    ClipFraction,
    InputTokenCount,
    MeanCompletionLength,
    MeanRatio,
    MeanTokenEntropy,
    MeanTokenKL,
    MeanTokenLoss,
    PolicyLoss,
    PolicySurrogateLoss,
    SequencePerplexity,
    TargetTokenCount,
    TokenAccuracy,
    TokenPerplexity,
    TokensPerSecond,
    sequence_totals,
)
from lightning_cp.loss.mixin import CPLossMixin
from lightning_cp.loss.objective import GlobalTokenObjective
from lightning_cp.loss.policy import PolicyObjective
from lightning_cp.loss.policy_registry import (
    AggregationInputs,
    AggregationWeights,
    PolicyLossTerms,
    PolicyTokens,
    register_aggregation,
    register_policy_loss,
)

__all__ = [
    "AggregationInputs",
    "AggregationWeights",
    "CPLossMixin",
    "ClipFraction",
    "GlobalTokenObjective",
    "InputTokenCount",
    "MeanCompletionLength",
    "MeanRatio",
    "MeanTokenEntropy",
    "MeanTokenKL",
    "MeanTokenLoss",
    "PolicyLoss",
    "PolicyLossTerms",
    "PolicyObjective",
    "PolicySurrogateLoss",
    "PolicyTokens",
    "SequencePerplexity",
    "TargetTokenCount",
    "TokenAccuracy",
    "TokenPerplexity",
    "TokensPerSecond",
    "register_aggregation",
    "register_policy_loss",
    "sequence_totals",
]
