"""A GRPO-style policy loss built on ``lightning_cp.ops.token_logprobs``, on tiny random data (CPU).

Run it (a few seconds)::

    python examples/rl_policy_loss.py

The setting of RL fine-tuning: ``P`` prompts, ``G`` sampled completions each, one scalar reward per
completion. Here the tokens and rewards are random; in practice the completions come from the policy
(whose log-probabilities at sampling time are ``old_logp``) and the rewards from a verifier or a reward
model. For every completion token ``t`` of sequence ``i``::

    ratio   = exp(logp - old_logp)
    A_i     = (r_i - mean(r of i's group)) / (std(r of i's group) + 1e-6)      # GRPO advantage
    policy  = -min(ratio * A_i, clip(ratio, 1 - clip_eps, 1 + clip_eps) * A_i)
    kl      = exp(ref_logp - logp) - (ref_logp - logp) - 1                       # k3 estimator, >= 0
    loss    = mean over completion tokens of (policy + kl_coef * kl) - entropy_coef * (mean entropy)

``token_logprobs_with_entropy(hidden, weight, labels, temperature=...)`` gives ``logp`` and the
entropy per token from the final hidden states and the LM-head weight, differentiable w.r.t. both, without
the ``[tokens, vocab]`` logits (the same chunked pass as the training loss). ``temperature`` must be the
sampling temperature, so that ``logp`` is the log-probability of the distribution the completions came
from. The reference model's ``ref_logp`` come from the same function under ``torch.no_grad()``.

The script first checks the fused values and gradients against ``log_softmax`` of materialized logits,
then takes a few optimizer steps on the same rollouts (PPO-style epochs), printing the loss terms.

This is the op underneath, on one process. To train under :class:`~lightning_cp.MegatronCPStrategy`, use
``CPLossMixin.policy_loss(hidden, head, batch, PolicyObjective(...))`` (or ``HFCausalLM(objective=...)``) on
rollout batches of :class:`~lightning_cp.data.RolloutDataModule`: it takes the per-sequence and global sums
over the right groups, so the objective is the same at any DP x CP (the README's "Reinforcement learning").
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_cp.models import GPT, GPTConfig
from lightning_cp.ops import (
    token_logprobs,
    token_logprobs_with_entropy,
)

PROMPTS, GROUP = 2, 4  # 2 prompts x 4 completions = 8 sequences
PROMPT_LEN, COMPLETION_LEN = 8, 12
TEMPERATURE = 0.8  # the sampling temperature of the rollouts
CLIP_EPS, KL_COEF, ENTROPY_COEF = 0.2, 0.05, 0.01
STEPS = 3


def rollouts(vocab_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``input_ids`` ``[B, S]``, next-token ``labels`` (-100 outside completions) and rewards ``[B]``.

    Completions have 4 to ``COMPLETION_LEN`` tokens and are right-padded with 0 (padding is not scored).
    """
    batch = PROMPTS * GROUP
    prompts = torch.randint(0, vocab_size, (PROMPTS, 1, PROMPT_LEN), generator=generator).expand(
        -1, GROUP, -1
    )
    completions = torch.randint(0, vocab_size, (PROMPTS, GROUP, COMPLETION_LEN), generator=generator)
    input_ids = torch.cat([prompts, completions], dim=-1).reshape(batch, -1)
    lengths = torch.randint(4, COMPLETION_LEN + 1, (batch, 1), generator=generator)
    in_completion = torch.arange(COMPLETION_LEN) < lengths
    input_ids[:, PROMPT_LEN:] *= in_completion
    labels = torch.full_like(input_ids, -100)
    # Position t scores token t + 1: the last prompt token predicts the first completion token.
    labels[:, PROMPT_LEN - 1 : -1] = torch.where(in_completion, input_ids[:, PROMPT_LEN:], -100)
    rewards = torch.randn(batch, generator=generator)
    return input_ids, labels, rewards


def group_advantages(rewards: Tensor) -> Tensor:
    """GRPO: each reward standardized within the completions of its prompt; ``[B]``."""
    grouped = rewards.view(PROMPTS, GROUP)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).flatten()


def hidden_states(model: GPT, input_ids: Tensor) -> Tensor:
    """``[B * S, n_embd]`` final hidden states (one process, so positions are ``0..S-1``)."""
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return model(input_ids, positions).flatten(0, 1)


def logprobs(model: GPT, input_ids: Tensor, labels: Tensor) -> Tensor:
    """``log p(label)`` ``[B * S]`` under ``model`` at the sampling temperature (0 where the label is -100)."""
    hidden = hidden_states(model, input_ids)
    return token_logprobs(hidden, model.lm_head_weight, labels.flatten(), temperature=TEMPERATURE)


def logprobs_and_entropy(model: GPT, input_ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`logprobs` and the entropy ``[B * S]`` of each token's distribution, both differentiable."""
    hidden = hidden_states(model, input_ids)
    weight = model.lm_head_weight
    return token_logprobs_with_entropy(hidden, weight, labels.flatten(), temperature=TEMPERATURE)


def policy_loss(
    logp: Tensor, entropy: Tensor, old_logp: Tensor, ref_logp: Tensor, advantages: Tensor, labels: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """The clipped objective with KL penalty and entropy bonus; per-token inputs ``[B * S]``, mean over completions."""
    mask = (labels != -100).flatten().float()
    count = mask.sum()
    advantage = advantages.repeat_interleave(labels.shape[1])
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS)
    policy = -torch.minimum(ratio * advantage, clipped * advantage)
    log_ratio_ref = ref_logp - logp
    kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1

    def mean(x: Tensor) -> Tensor:
        return (x * mask).sum() / count

    loss = mean(policy + KL_COEF * kl) - ENTROPY_COEF * mean(entropy)
    stats = {
        "policy": mean(policy).item(),
        "kl": mean(kl).item(),
        "entropy": mean(entropy).item(),
        "clip_frac": mean((ratio != clipped).float()).item(),
    }
    return loss, stats


def materialized_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The plain-PyTorch reference: ``log_softmax`` of the full ``[N, V]`` logits at the same temperature."""
    log_softmax = F.log_softmax((hidden @ weight.T).float() / TEMPERATURE, dim=-1)
    valid = labels != -100
    logp = log_softmax.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * valid
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) * valid
    return logp, entropy


def check_against_logits(
    policy: GPT, input_ids: Tensor, labels: Tensor, ref_logp: Tensor, advantages: Tensor
) -> None:
    """Same values and gradients as with materialized logits (printed as maximum differences)."""
    hidden = hidden_states(policy, input_ids)
    weight = policy.lm_head_weight
    fused = token_logprobs_with_entropy(hidden, weight, labels.flatten(), temperature=TEMPERATURE)
    plain = materialized_logprobs(hidden, weight, labels.flatten())
    grads = []
    for logp, entropy in (fused, plain):
        loss, _ = policy_loss(logp, entropy, logp.detach() - 0.1, ref_logp, advantages, labels)  # ratio != 1
        grads.append(
            torch.cat([g.flatten() for g in torch.autograd.grad(loss, (hidden, weight), retain_graph=True)])
        )
    print(
        "token_logprobs vs log_softmax(logits): "
        f"max |logp diff| {(fused[0] - plain[0]).abs().max():.2e}, "
        f"max |entropy diff| {(fused[1] - plain[1]).abs().max():.2e}, "
        f"max |grad diff| {(grads[0] - grads[1]).abs().max():.2e} (grad scale {grads[1].abs().max():.2e})"
    )


def main() -> None:
    torch.manual_seed(0)
    policy = GPT(GPTConfig(vocab_size=128, n_layer=2, n_head=2, n_embd=32))
    reference = copy.deepcopy(policy).requires_grad_(False)  # frozen: the model before RL fine-tuning
    input_ids, labels, rewards = rollouts(128, torch.Generator().manual_seed(0))
    advantages = group_advantages(rewards)
    with torch.no_grad():
        old_logp = logprobs(policy, input_ids, labels)  # recorded once, when the completions were sampled
        ref_logp = logprobs(reference, input_ids, labels)
    check_against_logits(policy, input_ids, labels, ref_logp, advantages)

    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for step in range(STEPS):
        logp, entropy = logprobs_and_entropy(policy, input_ids, labels)
        loss, stats = policy_loss(logp, entropy, old_logp, ref_logp, advantages, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():+.6f}  " + "  ".join(f"{k} {v:.6f}" for k, v in stats.items()))


if __name__ == "__main__":
    main()
