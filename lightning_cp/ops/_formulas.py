"""The loss formulas: per-token losses from the softmax statistics, and the coefficients of their logits gradient.

Every loss of :mod:`lightning_cp.ops` has a logits gradient ``dL/ds_j = p_j * (alpha + beta * s_j) -
gamma * [j == label] - eta`` with per-token coefficients (:class:`GradCoefs`); the engine (``_engine``)
hands them to a backend, which writes that gradient chunk by chunk. Only arithmetic on ``[n]`` vectors here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_cp.ops.token_stats import TokenStats

_REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class CEOptions:
    """The cross-entropy options of the public functions."""

    reduction: str
    label_smoothing: float
    z_loss: float

    @classmethod
    def build(cls, *, reduction: str, label_smoothing: float, z_loss: float) -> CEOptions:
        """Validate the user's options (errors name the argument)."""
        if reduction not in _REDUCTIONS:
            raise ValueError(f"`reduction` must be one of {_REDUCTIONS}, got {reduction!r}.")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"`label_smoothing` must be in [0, 1], got {label_smoothing}.")
        if not z_loss >= 0.0:
            raise ValueError(f"`z_loss` must be >= 0, got {z_loss}.")
        return cls(reduction=reduction, label_smoothing=float(label_smoothing), z_loss=float(z_loss))


@dataclass(frozen=True)
class GradCoefs:
    """Per-token coefficients ``[n]`` (fp32) of ``dL/ds_j = p_j (alpha + beta s_j) - gamma [j = y] - eta``."""

    lse: torch.Tensor
    alpha: torch.Tensor
    gamma: torch.Tensor
    beta: torch.Tensor | None = None
    eta: torch.Tensor | None = None

    def scaled(self, factor: float) -> GradCoefs:
        """The coefficients of ``factor`` times this gradient (the formula is linear in them)."""
        if factor == 1.0:
            return self
        return GradCoefs(
            lse=self.lse,
            alpha=self.alpha * factor,
            gamma=self.gamma * factor,
            beta=None if self.beta is None else self.beta * factor,
            eta=None if self.eta is None else self.eta * factor,
        )

    def logits_grad(self, chunk, out: torch.Tensor | None = None) -> torch.Tensor:
        """The backend ``chunk``'s gradient w.r.t. its logits (see ``TorchChunk.grad``)."""
        return chunk.grad(self.lse, self.alpha, self.gamma, self.beta, self.eta, out=out)


CoefsOf = Callable[[int, int], GradCoefs]
"""The coefficients of the tokens ``[start, stop)``."""


def ce_token_loss(stats: TokenStats, opts: CEOptions, vocab: int) -> torch.Tensor:
    """Per-token cross-entropy ``[N]`` fp32 (smoothing and z-loss included), 0 at ignored tokens."""
    loss = stats.lse - stats.target
    if opts.label_smoothing:
        loss = (1.0 - opts.label_smoothing) * loss + opts.label_smoothing * (stats.lse - stats.total / vocab)
    if opts.z_loss:
        loss = loss + opts.z_loss * stats.lse.square()
    return torch.where(stats.valid, loss, 0.0)


def reduce_loss(token_loss: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    """``mean`` over ``count`` valid tokens (0 when there are none), ``sum``, or ``none``."""
    if reduction == "none":
        return token_loss
    total = token_loss.sum()
    return total / count.clamp(min=1) if reduction == "mean" else total


def output_scale(grad_loss: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    """d(loss)/d(token loss) of a valid token: per token for ``none``, a 0-d tensor otherwise."""
    return grad_loss / count.clamp(min=1) if reduction == "mean" else grad_loss


def ce_coefs(lse: torch.Tensor, weight: torch.Tensor, opts: CEOptions, vocab: int) -> GradCoefs:
    """Coefficients of ``weight`` (per token) times the token cross-entropy."""
    # d/ds_j of weight * [(1 - eps)(lse - s_y) + eps (lse - sum(s) / V) + z_loss * lse^2]
    #   = weight * [p_j (1 + 2 z_loss lse) - (1 - eps) [j = y] - eps / V]
    eps = opts.label_smoothing
    alpha = weight * (1.0 + 2.0 * opts.z_loss * lse) if opts.z_loss else weight
    return GradCoefs(
        lse=lse,
        alpha=alpha,
        gamma=weight * (1.0 - eps),
        eta=weight * (eps / vocab) if eps else None,
    )


def logprob_coefs(
    lse: torch.Tensor,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    mean_s: torch.Tensor | None,
    inv_temp: float,
) -> GradCoefs:
    """Coefficients of ``grad_logprob * logprob + grad_entropy * entropy`` (per token)."""
    # logprob = s_y - lse:            d/ds_j = [j = y] - p_j
    # entropy = lse - sum_k p_k s_k:  d/ds_j = p_j (E[s] - s_j)
    # and ds/dz carries the 1 / temperature, folded in here.
    if grad_entropy is None:
        return GradCoefs(lse=lse, alpha=-inv_temp * grad_logprob, gamma=-inv_temp * grad_logprob)
    return GradCoefs(
        lse=lse,
        alpha=inv_temp * (grad_entropy * mean_s - grad_logprob),
        gamma=-inv_temp * grad_logprob,
        beta=-inv_temp * grad_entropy,
    )
