"""Policy-gradient objectives of reinforcement learning (PPO / GRPO / GSPO / Dr. GRPO), from this rank's tokens.

A micro-batch holds rollouts (prompt + sampled completion; the completion tokens are the targets) in the
batch contract's keys (``docs/design.md``, "The batch contract"), sharded by ``shard_batch``, which puts
every value about a target token on the position that predicts it. For each target token ``t`` of
sequence ``i`` (a row, or a packed document), with ``L_i`` the number of targets of ``i``::

    logp_t   log pi(y_t | y_<t), the policy's, at the sampling temperature (the fused head, no logits kept)
    old_t    batch["old_logprobs"]: the sampling policy's (``logp_t`` detached when absent: on-policy)
    ref_t    batch["ref_logprobs"]: the reference model's (needed for a KL term)
    A_t      batch["advantages"]: the advantage of the completion of ``t``

    ratio    "token":    r_t = exp(logp_t - old_t)
             "sequence": r_t = sg(s_i) * exp(logp_t - sg(logp_t)),  s_i = exp(sum_{t in i} (logp_t - old_t) / L_i)
    policy_t = -min(r_t * A_t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_t)      (loss "ppo")
    kl_t     "k1": logp_t - ref_t;  "k2": (logp_t - ref_t)^2 / 2;  "k3": exp(ref_t - logp_t) - (ref_t - logp_t) - 1
    loss_t   = policy_t + kl_coef * kl_t - entropy_coef * entropy_t

The sequence ratio is GSPO's in its token form (GSPO-token: every token carries the value of its sequence's
ratio, its gradient that of its own log-probability); with ``seq-mean-token-mean`` it is GSPO's sequence
objective, value and gradient. The loss is aggregated over the **global batch of the optimizer step** (every
DP and CP rank, every gradient-accumulation micro-batch):

=========================  ===============================================================================
``token-mean``             ``sum_t loss_t / (number of targets)``
``seq-mean-token-mean``    ``sum_i (sum_{t in i} loss_t / L_i) / (number of sequences)``
``seq-mean-token-sum``     ``sum_i sum_{t in i} loss_t / (number of sequences * token_normalizer)`` (Dr. GRPO,
                           with the largest completion length as the constant)
=========================  ===============================================================================

The policy loss and the aggregation are looked up by name (:mod:`lightning_cp.loss.policy_registry`,
where a user registers others); :func:`policy_terms` is the frame they all run in. Sequences without a
target count in none. Under CP a sequence's tokens sit on several ranks, so ``s_i`` and
``L_i`` are taken from the sequence's sums over the CP group (one all-reduce of ``2 * n`` numbers, ``n``
sequences, as the language-model metrics already do) and the global normalizer from one all-reduce over DP x
CP (:class:`~lightning_cp.loss.objective.GlobalTokenObjective`, which also turns the first micro-batch's
normalizer into the step's). Everything else is this rank's own tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_cp.constants import ADVANTAGES, CP_SHARD, IGNORE_INDEX, LABELS, OLD_LOGPROBS, REF_LOGPROBS
from lightning_cp.loss.metrics import (
    ClipFraction,
    MeanCompletionLength,
    MeanRatio,
    MeanTokenEntropy,
    MeanTokenKL,
    PolicyLoss,
    PolicySurrogateLoss,
    sequence_totals,
)
from lightning_cp.loss.policy_registry import (
    AggregationInputs,
    PolicyTokens,
    aggregation_named,
    policy_loss_named,
    token_normalizer_aggregations,
)
from lightning_cp.parallel.layout import ParallelLayout

RatioLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]


@dataclass(frozen=True)
class PolicyObjective:
    """The policy-gradient objective and how it is aggregated (the module docstring's formulas).

    Args:
        clip_low: ``r_t`` is clipped below at ``1 - clip_low`` (PPO's epsilon).
        clip_high: the upper bound is ``1 + clip_high``; ``None``: ``clip_low`` (symmetric). DAPO's
            "clip-higher" sets it above ``clip_low`` (0.28 with ``clip_low=0.2``).
        ratio: ``"token"`` (PPO / GRPO) or ``"sequence"`` (GSPO: the sequence's mean log-ratio).
        kl_coef: weight of the KL term to the reference log-probs (0: none; then ``ref_logprobs`` are
            optional, and only logged when present).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (Schulman's estimators of ``KL(pi || ref)``; GRPO uses k3).
        entropy_coef: weight of the entropy bonus (subtracted).
        aggregation: ``"token-mean"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"``, or one registered
            with :func:`~lightning_cp.loss.register_aggregation`.
        token_normalizer: ``"seq-mean-token-sum"``'s constant per sequence (Dr. GRPO: the largest completion
            length the sampler allowed); must stay 1 with aggregations that do not read it.
        temperature: the sampling temperature of the rollouts: the log-probs are those of
            ``softmax(logits / temperature)``, the distribution the completions were drawn from.
        loss: the per-token policy loss, by its registered name: ``"ppo"``, PPO's clipped surrogate, or one
            registered with :func:`~lightning_cp.loss.register_policy_loss`.

    Raises:
        ValueError: a clip bound that is negative or not finite (or ``clip_low >= 1``), an unknown ratio or
            estimator, a loss or aggregation that is not registered (the message lists those that are), a
            negative coefficient, a ``token_normalizer`` that is not positive or is set for an aggregation
            that does not read it, a temperature that is not positive.
    """

    clip_low: float = 0.2
    clip_high: float | None = None
    ratio: RatioLevel = "token"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    aggregation: str = "token-mean"
    token_normalizer: float = 1.0
    temperature: float = 1.0
    loss: str = "ppo"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_low) and 0.0 <= self.clip_low < 1.0):
            raise ValueError(f"PolicyObjective(clip_low={self.clip_low}) must be in [0, 1) (PPO uses 0.2).")
        if self.clip_high is not None and not (math.isfinite(self.clip_high) and self.clip_high >= 0.0):
            raise ValueError(
                f"PolicyObjective(clip_high={self.clip_high}) must be >= 0 and finite (DAPO uses 0.28), or None."
            )
        for name, value, allowed in (
            ("ratio", self.ratio, ("token", "sequence")),
            ("kl_estimator", self.kl_estimator, ("k1", "k2", "k3")),
        ):
            if value not in allowed:
                raise ValueError(
                    f"PolicyObjective({name}={value!r}) is not one of {', '.join(map(repr, allowed))}."
                )
        policy_loss_named(self.loss)
        aggregation_named(self.aggregation)
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"PolicyObjective({name}={value}) must be a finite number >= 0.")
        if not (math.isfinite(self.token_normalizer) and self.token_normalizer > 0.0):
            raise ValueError(f"PolicyObjective(token_normalizer={self.token_normalizer}) must be > 0.")
        readers = token_normalizer_aggregations()
        if self.token_normalizer != 1.0 and self.aggregation not in readers:
            raise ValueError(
                f"PolicyObjective(token_normalizer={self.token_normalizer}) only applies to "
                f"{' / '.join(f'aggregation={name!r}' for name in readers)}, not {self.aggregation!r}: "
                "leave it at 1."
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0.0):
            raise ValueError(f"PolicyObjective(temperature={self.temperature}) must be > 0 (the sampler's).")

    @property
    def upper_clip(self) -> float:
        """``clip_high``, or ``clip_low`` when it is ``None``."""
        return self.clip_low if self.clip_high is None else self.clip_high


class PolicyTerms(NamedTuple):
    """This rank's part of a micro-batch's policy objective.

    ``loss_sum`` (fp32 scalar, differentiable) over ``normalizer`` summed over DP x CP is the micro-batch's
    objective; ``totals`` are the metric inputs (detached, this rank's; see :func:`default_policy_metrics`).
    """

    loss_sum: Tensor
    normalizer: Tensor
    totals: dict[str, Tensor]


def policy_terms(
    logprobs: Tensor,
    entropy: Tensor,
    batch: Mapping[str, Tensor],
    objective: PolicyObjective,
    layout: ParallelLayout,
) -> PolicyTerms:
    """The objective's numerator and normalizer of this rank's tokens, and its metric totals.

    Args:
        logprobs: ``[N]`` fp32 ``logp_t`` of this rank's ``N = B * S_local`` tokens (0 where ``labels`` is
            ``-100``), differentiable.
        entropy: ``[N]`` fp32 entropy of each token's distribution (0 there), differentiable.
        batch: the sharded batch: ``labels`` ``[B, S_local]``, ``advantages`` ``[B, S_local]``, optional
            ``old_logprobs`` / ``ref_logprobs`` ``[B, S_local]`` (shifted with the labels by ``shard_batch``)
            and ``cp_shard``.
        objective: the objective.
        layout: the running layout (``cp_group``, ``cp_rank``).

    Returns:
        :class:`PolicyTerms`.

    Communication: one all-reduce of ``2 * n`` float64 values over ``layout.cp_group`` (the ``n`` sequences'
    log-ratio sums and target counts); every CP rank must call it.

    Raises:
        ValueError: no ``advantages`` or ``cp_shard`` in the batch, or no ``ref_logprobs`` while
            ``kl_coef > 0``.
    """
    _check_batch(batch, objective)
    valid = batch[LABELS].reshape(-1) != IGNORE_INDEX
    old = _token_values(batch, OLD_LOGPROBS) if OLD_LOGPROBS in batch else logprobs.detach()
    log_ratio = torch.where(valid, logprobs - old, 0.0)
    shard = batch[CP_SHARD]
    per_sequence = sequence_totals(
        torch.stack([log_ratio.detach().double(), valid.double()], dim=1),
        shard.sequence_index,
        shard.num_sequences,
        layout.cp_group,
    )
    sequence_targets = per_sequence[:, 1]
    if objective.ratio == "sequence":
        mean_log_ratio = (per_sequence[:, 0] / sequence_targets.clamp(min=1))[shard.sequence_index].float()
        log_ratio = torch.where(valid, mean_log_ratio + logprobs - logprobs.detach(), 0.0)
    tokens = PolicyTokens(logprobs, old, log_ratio, _token_values(batch, ADVANTAGES), valid)
    policy = policy_loss_named(objective.loss)(tokens, objective)
    _check_per_token(f"loss={objective.loss!r}", "loss", policy.loss, valid)
    # Off target a loss's terms are nobody's: zeroed here, so that no registered loss has to.
    surrogate = torch.where(valid, policy.loss, 0.0)
    clipped = torch.zeros_like(valid) if policy.clipped is None else valid & policy.clipped
    # sequence_targets is the CP group's sum, the same on every peer: CP rank 0 alone counts the sequences.
    sequences = (
        (sequence_targets > 0).sum() if layout.cp_rank == 0 else valid.new_zeros((), dtype=torch.int64)
    )
    weights, normalizer = aggregation_named(objective.aggregation)(
        AggregationInputs(valid, sequence_targets[shard.sequence_index].float(), valid.sum(), sequences),
        objective,
    )
    _check_per_token(f"aggregation={objective.aggregation!r}", "weights", weights, valid)
    loss = surrogate - objective.entropy_coef * entropy
    totals = {}
    if REF_LOGPROBS in batch:
        kl = torch.where(
            valid, _kl(logprobs, _token_values(batch, REF_LOGPROBS), objective.kl_estimator), 0.0
        )
        loss = loss + objective.kl_coef * kl
        totals["kl_sum"] = kl.detach().double().sum()
    loss_sum = (weights * loss).sum()
    totals |= {
        "objective_sum": loss_sum.detach().double(),
        "objective_normalizer": normalizer.double(),
        "surrogate_sum": (weights * surrogate).detach().double().sum(),
        "clipped_count": clipped.sum().double(),
        "ratio_sum": torch.where(valid, log_ratio.detach().exp(), 0.0).double().sum(),
        "entropy_sum": entropy.detach().double().sum(),
        "valid_count": valid.sum().double(),
        "sequence_count": sequences.double(),
    }
    return PolicyTerms(loss_sum, normalizer, totals)


def default_policy_metrics() -> dict[str, Metric]:
    """The metrics logged under ``{stage}/rl/`` (a set per stage) by
    :meth:`~lightning_cp.CPLossMixin.policy_loss`, each the same for every DP x CP layout:

    ``loss`` (the aggregated objective, as trained), ``pg_loss`` (its clipped-surrogate part, aggregated
    alike), ``clip_fraction`` (share of targets whose clipped term is taken: their gradient is zero),
    ``ratio_mean`` (token mean of ``r_t``), ``kl`` (token mean of ``kl_t``; only with ``ref_logprobs``),
    ``entropy`` (token mean), ``completion_length`` (mean targets per sequence).
    """
    return {
        "loss": PolicyLoss(),
        "pg_loss": PolicySurrogateLoss(),
        "clip_fraction": ClipFraction(),
        "ratio_mean": MeanRatio(),
        "kl": MeanTokenKL(),
        "entropy": MeanTokenEntropy(),
        "completion_length": MeanCompletionLength(),
    }


def _check_batch(batch: Mapping[str, Tensor], objective: PolicyObjective) -> None:
    missing = [key for key in (ADVANTAGES, CP_SHARD) if key not in batch]
    if missing:
        raise ValueError(
            f"The policy loss needs a sharded rollout batch with {', '.join(map(repr, missing))} "
            f"(keys: {sorted(batch)}); RolloutDataModule makes one, and the strategy (or "
            "lightning_cp.parallel.shard_batch(batch, 1, 0) without it) shards it."
        )
    if objective.kl_coef > 0 and REF_LOGPROBS not in batch:
        raise ValueError(
            f"PolicyObjective(kl_coef={objective.kl_coef}) needs the reference model's log-probs in "
            f"batch[{REF_LOGPROBS!r}]: give the rollouts ref_logprobs (lightning-cp predict with the reference "
            "checkpoint writes them), or set kl_coef=0."
        )


def _check_per_token(registered: str, field: str, values: Tensor, valid: Tensor) -> None:
    """A registered function's per-token result must have one value per token (no silent broadcast)."""
    if values.shape != valid.shape:
        raise ValueError(
            f"PolicyObjective({registered}) returned {field} of shape {tuple(values.shape)}; it must give one "
            f"value per token of the rank, shape {tuple(valid.shape)} (PolicyTokens' / AggregationInputs' own)."
        )


def _token_values(batch: Mapping[str, Tensor], key: str) -> Tensor:
    """``batch[key]`` ``[B, S_local]`` as ``[N]`` fp32."""
    return batch[key].reshape(-1).float()


def _kl(logprobs: Tensor, ref: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of ``KL(pi || ref)`` from ``d = logp - ref`` (k3 is ``exp(-d) + d - 1 >= 0``)."""
    difference = logprobs - ref
    if estimator == "k1":
        return difference
    if estimator == "k2":
        return 0.5 * difference.square()
    return torch.expm1(-difference) + difference
