"""The per-token policy losses and the aggregations of :class:`~lightning_cp.PolicyObjective`, by name.

``PolicyObjective(loss=..., aggregation=...)`` names one of each. A **policy loss** turns this rank's target
tokens into per-token terms ``policy_t`` (:class:`PolicyTokens` in, :class:`PolicyLossTerms` out); an
**aggregation** gives each token's weight in the numerator and this rank's share of the normalizer
(:class:`AggregationInputs` in, :class:`AggregationWeights` out). Neither communicates:
:func:`~lightning_cp.loss.policy.policy_terms`, the one CP-exact frame every registered pair runs in, hands
them the sequence-level values already summed over the CP group, adds the KL and entropy terms, and sums
numerator and normalizer over DP x CP and the micro-batches of the optimizer step. A loss registered here is
therefore exact at every DP x CP layout, padded or packed, with gradient accumulation.

Built in: the loss ``"ppo"`` (PPO's clipped surrogate at the objective's ratio level: PPO / GRPO / DAPO, GSPO
with ``ratio="sequence"``) and the aggregations ``"token-mean"``, ``"seq-mean-token-mean"`` and
``"seq-mean-token-sum"`` (Dr. GRPO, with ``token_normalizer``); :mod:`lightning_cp.loss.policy` has the
formulas. Register more in a module your run imports before the objective is built (the module of your
``LightningModule``, or the script): ``docs/usage.md``'s "Your own policy loss" registers CISPO.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_cp.loss.policy import PolicyObjective


class PolicyTokens(NamedTuple):
    """What a policy loss reads of this rank's ``N = B * S_local`` tokens: fp32 ``[N]`` tensors (``valid``:
    bool), each token's value on the position that predicts it. Off target (``~valid``) every value is 0 and
    the frame ignores the loss's terms there."""

    logprobs: Tensor
    """``logp_t``, the policy's at the objective's temperature; differentiable."""
    old_logprobs: Tensor
    """``old_t``, the sampling policy's (``logp_t`` detached when the batch has none: on-policy); no gradient."""
    log_ratio: Tensor
    """``log r_t`` at the objective's ``ratio`` level: ``logp_t - old_t`` (``"token"``), or GSPO's
    ``sg(mean_{u in i} (logp_u - old_u)) + logp_t - sg(logp_t)`` over the token's whole sequence ``i``, its
    CP peers' tokens included (``"sequence"``); differentiable."""
    advantages: Tensor
    """``A_t``, the advantage of the token's completion."""
    valid: Tensor
    """Whether the token is a target (its ``labels`` is not ``-100``)."""


class PolicyLossTerms(NamedTuple):
    """A policy loss's result on this rank's tokens."""

    loss: Tensor
    """``[N]`` fp32 ``policy_t``, differentiable; its aggregate is logged as ``pg_loss``."""
    clipped: Tensor | None = None
    """``[N]`` bool, the targets whose gradient the loss cuts (logged as ``clip_fraction``); ``None``: none."""


class AggregationInputs(NamedTuple):
    """What an aggregation reads: this rank's tokens and its share of the global batch's counts (each a share:
    summed over DP x CP, a count is the micro-batch's)."""

    valid: Tensor
    """``[N]`` bool, the targets."""
    sequence_targets: Tensor
    """``[N]`` fp32 ``L_i``, the targets of each token's sequence, its CP peers' included."""
    token_count: Tensor
    """Scalar int64: this rank's targets."""
    sequence_count: Tensor
    """Scalar int64: the sequences with a target that this rank counts (CP rank 0 counts them; its peers 0)."""


class AggregationWeights(NamedTuple):
    """An aggregation's result: the objective is ``sum(weights * loss_t) / normalizer``, both summed over DP x CP
    (and the micro-batches of the step), so ``normalizer`` must be a sum of shares such as
    :class:`AggregationInputs`' counts times a constant, never a rank's own mean."""

    weights: Tensor
    """``[N]`` fp32, each token's weight in the numerator (0 off target)."""
    normalizer: Tensor
    """Scalar: this rank's share of the denominator."""


PolicyLossFunction = Callable[[PolicyTokens, "PolicyObjective"], PolicyLossTerms]
"""``(tokens, objective) -> PolicyLossTerms``: per-token terms from this rank's tokens, no communication."""
AggregationFunction = Callable[[AggregationInputs, "PolicyObjective"], AggregationWeights]
"""``(inputs, objective) -> AggregationWeights``: weights and this rank's normalizer share, no communication."""


class _RegisteredAggregation(NamedTuple):
    function: AggregationFunction
    token_normalizer: bool


_POLICY_LOSSES: dict[str, PolicyLossFunction] = {}
_AGGREGATIONS: dict[str, _RegisteredAggregation] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFunction], PolicyLossFunction]:
    """Register the decorated function as ``PolicyObjective(loss=name)``.

    The function takes ``(tokens: PolicyTokens, objective: PolicyObjective)`` and returns
    :class:`PolicyLossTerms`; it sees this rank's tokens only and must not communicate (the frame, module
    docstring, makes any registered loss exact under CP). Registering the same function again (a module
    imported twice) is allowed.

    Raises:
        ValueError: ``name`` is empty, or already names another function.
    """
    return lambda function: _register(_POLICY_LOSSES, "policy loss", name, function, function)


def register_aggregation(
    name: str, *, token_normalizer: bool = False
) -> Callable[[AggregationFunction], AggregationFunction]:
    """Register the decorated function as ``PolicyObjective(aggregation=name)``.

    The function takes ``(inputs: AggregationInputs, objective: PolicyObjective)`` and returns
    :class:`AggregationWeights`, without communication. ``token_normalizer``: whether it reads
    ``objective.token_normalizer`` (other aggregations refuse a value other than 1).

    Raises:
        ValueError: ``name`` is empty, or already names another function.
    """

    def register(function: AggregationFunction) -> AggregationFunction:
        entry = _RegisteredAggregation(function, token_normalizer)
        _register(_AGGREGATIONS, "aggregation", name, entry, function)
        return function

    return register


def policy_loss_named(name: str) -> PolicyLossFunction:
    """The policy loss registered as ``name``.

    Raises:
        ValueError: no loss of that name, listing the registered ones.
    """
    return _lookup(_POLICY_LOSSES, "loss", "register_policy_loss", name)


def aggregation_named(name: str) -> AggregationFunction:
    """The aggregation registered as ``name``.

    Raises:
        ValueError: no aggregation of that name, listing the registered ones.
    """
    return _lookup(_AGGREGATIONS, "aggregation", "register_aggregation", name).function


def token_normalizer_aggregations() -> list[str]:
    """The registered aggregations that read ``token_normalizer``."""
    return [name for name, entry in _AGGREGATIONS.items() if entry.token_normalizer]


def _register(registry: dict, kind: str, name: str, entry: object, function: Callable) -> Callable:
    if not isinstance(name, str) or not name:
        raise ValueError(f"A {kind} is registered under a non-empty string, not {name!r}.")
    known = registry.get(name)
    if known is not None and _origin(getattr(known, "function", known)) != _origin(function):
        raise ValueError(
            f"The {kind} {name!r} is already registered ({_origin(getattr(known, 'function', known))}); "
            f"register {_origin(function)} under another name."
        )
    registry[name] = entry
    return function


def _origin(function: Callable) -> str:
    """Where a function is defined: the same for the function of a module imported again."""
    return f"{function.__module__}.{function.__qualname__}"


def _lookup(registry: dict, argument: str, register: str, name: str):
    if name not in registry:
        raise ValueError(
            f"PolicyObjective({argument}={name!r}) is not registered; the registered ones: "
            f"{', '.join(map(repr, registry))} (add one with lightning_cp.loss.{register})."
        )
    return registry[name]


@register_policy_loss("ppo")
def _clipped_surrogate(tokens: PolicyTokens, objective: PolicyObjective) -> PolicyLossTerms:
    """``-min(r_t * A_t, clip(r_t, 1 - clip_low, 1 + clip_high) * A_t)``; clipped where the clipped term is taken."""
    ratio = torch.exp(tokens.log_ratio)
    clipped_ratio = ratio.clamp(1.0 - objective.clip_low, 1.0 + objective.upper_clip)
    unclipped_loss, clipped_loss = -ratio * tokens.advantages, -clipped_ratio * tokens.advantages
    return PolicyLossTerms(torch.maximum(unclipped_loss, clipped_loss), clipped_loss > unclipped_loss)


@register_aggregation("token-mean")
def _token_mean(inputs: AggregationInputs, objective: PolicyObjective) -> AggregationWeights:
    return AggregationWeights(inputs.valid.float(), inputs.token_count)


@register_aggregation("seq-mean-token-mean")
def _sequence_mean_token_mean(inputs: AggregationInputs, objective: PolicyObjective) -> AggregationWeights:
    weights = torch.where(inputs.valid, 1.0 / inputs.sequence_targets.clamp(min=1), 0.0)
    return AggregationWeights(weights, inputs.sequence_count)


@register_aggregation("seq-mean-token-sum", token_normalizer=True)
def _sequence_mean_token_sum(inputs: AggregationInputs, objective: PolicyObjective) -> AggregationWeights:
    return AggregationWeights(inputs.valid.float(), inputs.sequence_count * objective.token_normalizer)
