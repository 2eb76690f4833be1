"""An independent, single-process implementation of the policy objectives, from materialized logits.

Written from the formulas (GSPO in its sequence form), one rollout at a time, for the tests to compare the
package's CP-local :meth:`CPLossMixin.policy_loss` against. Nothing of ``lightning_cp.loss`` is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Rollout:
    """One prompt + completion, with its advantage and the sampler's / reference model's log-probs."""

    prompt: list[int]
    completion: list[int]
    advantage: float
    old: list[float] | None = None
    ref: list[float] | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.completion


def completion_logprobs(logits: Tensor, rollout: Rollout, temperature: float) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` ``[L_c]`` of the completion tokens from the rollout's full ``[L, V]`` logits."""
    predicting = logits[len(rollout.prompt) - 1 : -1].float() / temperature
    log_softmax = torch.log_softmax(predicting, dim=-1)
    logp = log_softmax.gather(1, torch.tensor(rollout.completion)[:, None]).squeeze(1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return logp, entropy


def objective_of_step(
    rollouts: list[Rollout], logits: list[Tensor], objective
) -> tuple[Tensor, dict[str, float]]:
    """The objective of one optimizer step's global batch (every rollout of every rank and micro-batch)
    and its metrics, as the module docstring of ``lightning_cp.loss.policy`` defines them."""
    low, high = 1 - objective.clip_low, 1 + (objective.clip_high or objective.clip_low)
    numerator = torch.zeros(())
    surrogate_numerator = torch.zeros(())
    clipped = ratios = kls = entropies = tokens = 0.0
    for rollout, rollout_logits in zip(rollouts, logits, strict=True):
        logp, entropy = completion_logprobs(rollout_logits, rollout, objective.temperature)
        length = len(rollout.completion)
        old = logp.detach() if rollout.old is None else torch.tensor(rollout.old)
        advantage = rollout.advantage
        if objective.ratio == "sequence" and objective.aggregation == "seq-mean-token-mean":
            # GSPO as published: one ratio and one clipped term per sequence.
            ratio_seq = torch.exp((logp - old).mean())
            term = -torch.min(ratio_seq * advantage, ratio_seq.clamp(low, high) * advantage)
            per_token_surrogate = term.expand(length)
            ratio = ratio_seq.detach().expand(length)
            is_clipped = bool(ratio_seq.clamp(low, high) * advantage < ratio_seq * advantage) * torch.ones(
                length
            )
        else:
            if objective.ratio == "sequence":
                ratio = torch.exp((logp - old).mean().detach() + logp - logp.detach())
            else:
                ratio = torch.exp(logp - old)
            unclipped_term, clipped_term = -ratio * advantage, -ratio.clamp(low, high) * advantage
            per_token_surrogate = torch.max(unclipped_term, clipped_term)
            is_clipped = (clipped_term > unclipped_term).float()
            ratio = ratio.detach()
        per_token = per_token_surrogate - objective.entropy_coef * entropy
        if rollout.ref is not None:
            d = logp - torch.tensor(rollout.ref)
            kl = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) + d - 1}[objective.kl_estimator]
            per_token = per_token + objective.kl_coef * kl
            kls += kl.sum().item()
        if objective.aggregation == "seq-mean-token-mean":
            numerator = numerator + per_token.mean()
            surrogate_numerator = surrogate_numerator + per_token_surrogate.detach().mean()
        else:
            numerator = numerator + per_token.sum()
            surrogate_numerator = surrogate_numerator + per_token_surrogate.detach().sum()
        clipped += is_clipped.sum().item()
        ratios += ratio.sum().item()
        entropies += entropy.sum().item()
        tokens += length
    sequences = len(rollouts)
    normalizer = {
        "token-mean": tokens,
        "seq-mean-token-mean": sequences,
        "seq-mean-token-sum": sequences * objective.token_normalizer,
    }[objective.aggregation]
    loss = numerator / normalizer
    metrics = {
        "loss": loss.item(),
        "pg_loss": surrogate_numerator.item() / normalizer,
        "clip_fraction": clipped / tokens,
        "ratio_mean": ratios / tokens,
        "entropy": entropies / tokens,
        "completion_length": tokens / sequences,
    }
    if all(rollout.ref is not None for rollout in rollouts):
        metrics["kl"] = kls / tokens
    return loss, metrics
