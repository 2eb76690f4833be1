"""An independent, single-process implementation of the policy objectives, from materialized logits.

Written from the formulas (GSPO in its sequence form), one rollout at a time, for the tests to compare the
package's CP-local :meth:`CPLossMixin.policy_loss` against. Nothing of ``lightning_cp.loss`` is used.
"""

from __future__ import annotations

from collections.abc import Callable
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


def draw_rollouts(
    logits_of: Callable[[list[int]], Tensor],
    vocab: range,
    micro_batches: int,
    slots: int,
    *,
    temperature: float = 1.0,
    on_policy: bool = False,
    seed: int = 2,
) -> list[list[list[Rollout]]]:
    """``[micro-batch][slot]`` lists of two rollouts each: prompts of 1-5 tokens of ``vocab``, completions of
    2-11 (the first slot's second rollout of the last micro-batch: 1 token), advantages of both signs, old
    log-probs (``None`` when ``on_policy``) the policy's at ``temperature`` (``logits_of(ids)``: ``[L, V]``)
    plus noise, reference log-probs the policy's minus noise."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in range(micro_batches):
        out.append([])
        for s in range(slots):
            out[-1].append([])
            for k in range(2):
                prompt_len = int(torch.randint(1, 6, (), generator=g))
                single = (a, s, k) == (micro_batches - 1, 0, 1)
                completion_len = 1 if single else int(torch.randint(2, 12, (), generator=g))
                ids = torch.randint(
                    vocab.start, vocab.stop, (prompt_len + completion_len,), generator=g
                ).tolist()
                rollout = Rollout(ids[:prompt_len], ids[prompt_len:], float(torch.randn((), generator=g)))
                with torch.no_grad():
                    logp, _ = completion_logprobs(logits_of(ids), rollout, temperature)
                noise = 0.3 * torch.randn(completion_len, generator=g)
                rollout.old = None if on_policy else (logp + noise).tolist()
                rollout.ref = (logp - noise.abs()).tolist()
                out[-1][-1].append(rollout)
    return out


def samples(rollouts: list[Rollout]) -> list[dict[str, Tensor]]:
    """The rollouts as samples of the batch contract: every value on the token it is about."""
    out = []
    for r in rollouts:
        prompt = [0.0] * len(r.prompt)
        sample = {
            "input_ids": torch.tensor(r.ids),
            "loss_mask": torch.tensor(prompt + [1.0] * len(r.completion)),
            "advantages": torch.tensor(prompt + [r.advantage] * len(r.completion)),
            "ref_logprobs": torch.tensor(prompt + r.ref),
        }
        if r.old is not None:
            sample["old_logprobs"] = torch.tensor(prompt + r.old)
        out.append(sample)
    return out


def completion_logprobs(logits: Tensor, rollout: Rollout, temperature: float) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` ``[L_c]`` of the completion tokens from the rollout's full ``[L, V]`` logits."""
    predicting = logits[len(rollout.prompt) - 1 : -1].float() / temperature
    log_softmax = torch.log_softmax(predicting, dim=-1)
    logp = log_softmax.gather(1, torch.tensor(rollout.completion)[:, None]).squeeze(1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return logp, entropy


TokenLoss = Callable[[Tensor, Tensor, float, float, float], tuple[Tensor, Tensor]]
"""``(ratio, logp, advantage, low, high) -> (policy_t, clipped)`` of one rollout's ``[L_c]`` completion tokens:
a policy loss other than the clipped surrogate (``ratio`` at the objective's level, differentiable)."""


def objective_of_step(
    rollouts: list[Rollout], logits: list[Tensor], objective, token_loss: TokenLoss | None = None
) -> tuple[Tensor, dict[str, float]]:
    """The objective of one optimizer step's global batch (every rollout of every rank and micro-batch)
    and its metrics, as the module docstring of ``lightning_cp.loss.policy`` defines them; ``token_loss``
    replaces the clipped surrogate."""
    high_clip = objective.clip_low if objective.clip_high is None else objective.clip_high  # 0.0 is a bound
    low, high = 1 - objective.clip_low, 1 + high_clip
    numerator = torch.zeros(())
    surrogate_numerator = torch.zeros(())
    clipped = ratios = kls = entropies = tokens = 0.0
    for rollout, rollout_logits in zip(rollouts, logits, strict=True):
        logp, entropy = completion_logprobs(rollout_logits, rollout, objective.temperature)
        length = len(rollout.completion)
        old = logp.detach() if rollout.old is None else torch.tensor(rollout.old)
        advantage = rollout.advantage
        if (
            token_loss is None
            and objective.ratio == "sequence"
            and objective.aggregation == "seq-mean-token-mean"
        ):
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
            if token_loss is None:
                unclipped_term, clipped_term = -ratio * advantage, -ratio.clamp(low, high) * advantage
                per_token_surrogate = torch.max(unclipped_term, clipped_term)
                is_clipped = (clipped_term > unclipped_term).float()
            else:
                per_token_surrogate, is_clipped = token_loss(ratio, logp, advantage, low, high)
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
