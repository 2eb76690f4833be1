"""torchmetrics aggregators whose values are identical for every CP size.

A context-parallel rank sees only a slice of every sequence, so a loss averaged on one rank, or a
token count taken on one rank, is wrong by up to the CP size. Every metric here therefore keeps
*sums and counts* (plus min / max) as its state and reduces them over the right process group at
``compute()``, which makes the reduced value exact whatever the DP x CP layout:

Token-level metrics, fed with sums over this rank's local tokens, reduced over DP x CP by default:

- :class:`MeanTokenLoss`: ``update(loss_sum, valid_count)``, mean NLL per valid target token.
- :class:`TokenPerplexity`: ``update(loss_sum, valid_count)``, ``exp`` of the mean token NLL.
- :class:`TokenAccuracy`: ``update(correct_count, valid_count)``, accuracy of the arg-max prediction.
- :class:`MeanTokenEntropy`: ``update(entropy_sum, valid_count)``, mean entropy of the predicted distribution.
- :class:`InputTokenCount`: ``update(input_count)``, non-padding input tokens seen.
- :class:`TargetTokenCount`: ``update(valid_count)``, valid target tokens seen.
- :class:`TokensPerSecond`: ``update(input_count, seconds)``, global input tokens per wall second.

Sequence-level metric, fed with per-sequence totals already combined over CP (see
:func:`sequence_totals`), reduced over DP only by default:

- :class:`SequencePerplexity`: ``update(seq_nll_sum, seq_valid_count)``; ``statistic`` picks the
  mean, min or max of the per-sequence perplexities, or the number of sequences.

The default group is resolved when the metric synchronizes, not when it is built: metrics are
usually created in a ``LightningModule.__init__``, before the strategy has created Megatron's groups.
Without Megatron state both defaults are the world group (plain DDP, or one process).

States are float64 on whatever device the module is on, and stay float64 under ``module.to(dtype)``
(Lightning's ``"bf16-true"`` precision), because float32 counts stop being exact at 2**24 tokens.
``compute()`` returns a float64 scalar tensor, so ``self.log(name, metric)`` works.

``compute()`` is a collective over the metric's group: every rank of the group must call it, in the
same order for all metrics, or the ranks that did call it wait forever.

Update arguments have distinct names, and so do the states of metrics fed with different data, so
one :class:`~torchmetrics.MetricCollection` updated with keyword arguments feeds every metric and
its compute groups only ever merge metrics that really share their inputs::

    metrics = MetricCollection(
        {"loss": MeanTokenLoss(), "ppl": TokenPerplexity(), "tokens": TargetTokenCount()},
        prefix="train/",
    )
    metrics.update(loss_sum=nll.sum(), valid_count=mask.sum())
    self.log_dict(metrics)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_cp.parallel import groups
from lightning_cp.parallel.groups import ProcessGroup

SequenceStatistic = Literal["mean", "min", "max", "count"]
_SEQUENCE_STATISTICS: tuple[str, ...] = ("mean", "min", "max", "count")

__all__ = [
    "InputTokenCount",
    "MeanTokenEntropy",
    "MeanTokenLoss",
    "SequencePerplexity",
    "TargetTokenCount",
    "TokenAccuracy",
    "TokenPerplexity",
    "TokensPerSecond",
    "sequence_totals",
]


def sequence_totals(
    values: Tensor,
    sequence_index: Tensor,
    num_sequences: int,
    cp_group: ProcessGroup | None,
) -> Tensor:
    """Per-sequence totals of per-token values, summed over this rank's CP group.

    Under context parallelism every CP rank holds two chunks of each sequence, so a per-sequence
    quantity (its NLL sum, its number of valid targets) is only complete after the local partial
    sums of all CP peers are added. The result is then identical on every CP peer, which is why
    per-sequence metrics built from it are reduced over DP only.

    Args:
        values: ``[N]`` or ``[N, K]`` per-token values of this rank's local tokens, any real dtype;
            tokens that must not count (padding, masked prompts) carry 0. Several statistics can share
            one all-reduce by stacking them as ``K`` columns. Detached: this is for logging only.
        sequence_index: ``[N]`` int64, the sequence (``0 <= index < num_sequences``) of every local token;
            the same numbering on every CP peer (the global index of the sequence in the micro-batch).
        num_sequences: number of sequences in the micro-batch, the same on every CP peer.
        cp_group: the group whose partial sums are added (``groups.cp_group()``). Unlike the
            ``torch.distributed`` convention, ``None`` means *no* communication (no CP), not the world.

    Returns:
        ``[num_sequences]`` (or ``[num_sequences, K]``) totals, float64 for float64 ``values`` and
        float32 otherwise; identical on every rank of ``cp_group``.

    Communication: one all-reduce (SUM) of ``num_sequences * K`` elements over ``cp_group``;
    every rank of ``cp_group`` must call this function.
    """
    if values.ndim not in (1, 2) or sequence_index.shape != values.shape[:1]:
        raise ValueError(
            f"values must be [N] or [N, K] with sequence_index [N], got values {tuple(values.shape)} and "
            f"sequence_index {tuple(sequence_index.shape)}; flatten the local tokens first"
        )
    if num_sequences < 0:
        raise ValueError(f"num_sequences must be >= 0, got {num_sequences}")
    dtype = torch.promote_types(values.dtype, torch.float32)
    totals = values.new_zeros((num_sequences, *values.shape[1:]), dtype=dtype)
    totals.index_add_(0, sequence_index, values.detach().to(dtype))
    if cp_group is not None:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=cp_group)
    return totals


def _safe_ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, and 0.0 (never NaN) where the denominator is 0, without a host sync."""
    nonzero = denominator != 0
    return torch.where(nonzero, numerator / torch.where(nonzero, denominator, 1.0), 0.0)


class _GroupResolvingMetric(Metric):
    """Base of every metric here: a lazily resolved default group and float64 states.

    ``sync`` is the public hook that ``compute()`` goes through before reducing states, so it is
    where a missing ``process_group`` is replaced by ``_default_group()``: by then the strategy has
    initialized Megatron, which it had not when the metric was constructed.
    """

    is_differentiable: ClassVar[bool] = False
    full_state_update: ClassVar[bool] = False
    _default_group: ClassVar[Callable[[], ProcessGroup | None]]

    def _add_scalar_state(self, name: str, default: float, dist_reduce_fx: str) -> None:
        self.add_state(name, torch.tensor(default, dtype=torch.float64), dist_reduce_fx=dist_reduce_fx)

    def _as_scalar(self, value: Tensor | float, argument: str) -> Tensor:
        """``value`` as a detached float64 0-d tensor on the metric's device."""
        # A Python number goes straight to float64: through the default dtype (float32) a count
        # above 2**24 would already be rounded.
        value = value.detach() if isinstance(value, Tensor) else torch.tensor(value, dtype=torch.float64)
        if value.numel() != 1:
            raise ValueError(
                f"{argument} must be a scalar (a total over this rank's tokens), "
                f"got shape {tuple(value.shape)}; sum it before calling update()"
            )
        return value.to(device=self.device, dtype=torch.float64).reshape(())

    @override
    def sync(
        self,
        dist_sync_fn: Callable | None = None,
        process_group: Any | None = None,
        should_sync: bool = True,
        distributed_available: Callable | None = None,
    ) -> None:
        """:meth:`Metric.sync` over ``process_group``, else the constructor's group, else the default one."""
        if process_group is None:
            process_group = self.process_group if self.process_group is not None else self._default_group()
        super().sync(
            dist_sync_fn=dist_sync_fn,
            process_group=process_group,
            should_sync=should_sync,
            distributed_available=distributed_available,
        )

    @override
    def _apply(self, fn: Callable, exclude_state: Sequence[str] = ()) -> torch.nn.Module:
        # Lightning's "16-true" / "bf16-true" precision calls module.to(dtype), which would cast the
        # float64 sums to half precision (counts exact only up to 256). States follow the device only.
        this = super()._apply(fn, exclude_state=(*exclude_state, *self._defaults))
        for name, default in this._defaults.items():
            this._defaults[name] = default.to(this.device)
            setattr(this, name, getattr(this, name).to(this.device))
        return this


class _TokenMetric(_GroupResolvingMetric):
    """Token-level metric: states are sums over local tokens, reduced over DP x CP by default."""

    _default_group = staticmethod(groups.dp_cp_group)


class MeanTokenLoss(_TokenMetric):
    """Mean negative log-likelihood per valid target token of the global batch.

    States (float64, ``dist_reduce_fx="sum"``): ``nll_sum``, ``valid_count``.
    Default group: DP x CP (``groups.dp_cp_group()``, resolved at sync time); TP peers hold the
    same totals and are not part of it.

    ``compute()`` is ``sum(nll_sum) / sum(valid_count)`` over the group: the token-weighted mean,
    which a mean of per-rank means is not when ranks hold different numbers of valid targets.
    It is 0.0 while no valid token has been seen.

    Args:
        process_group: group to reduce over; ``None`` resolves to ``groups.dp_cp_group()`` at sync time.
        kwargs: further :class:`~torchmetrics.Metric` options (``sync_on_compute``, ...).
    """

    higher_is_better: ClassVar[bool] = False

    def __init__(self, process_group: ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self._add_scalar_state("nll_sum", 0.0, "sum")
        self._add_scalar_state("valid_count", 0.0, "sum")

    @override
    def update(self, loss_sum: Tensor | float, valid_count: Tensor | float) -> None:
        """Add one micro-batch of this rank.

        Args:
            loss_sum: scalar, the sum of per-token NLL over this rank's valid target tokens.
            valid_count: scalar, the number of those tokens.
        """
        self.nll_sum += self._as_scalar(loss_sum, "loss_sum")
        self.valid_count += self._as_scalar(valid_count, "valid_count")

    @override
    def compute(self) -> Tensor:
        return _safe_ratio(self.nll_sum, self.valid_count)


class TokenPerplexity(MeanTokenLoss):
    """Perplexity of the global batch: ``exp`` of :class:`MeanTokenLoss`.

    Same ``update(loss_sum, valid_count)``, states (``nll_sum``, ``valid_count``, float64 sums)
    and default group (DP x CP) as :class:`MeanTokenLoss`, so the logged perplexity is always the
    exponential of the logged loss; with no valid token yet that is ``exp(0.0) = 1.0``.
    """

    @override
    def compute(self) -> Tensor:
        return _safe_ratio(self.nll_sum, self.valid_count).exp()


class TokenAccuracy(_TokenMetric):
    """Fraction of valid target tokens whose arg-max prediction is the target.

    States (float64, ``dist_reduce_fx="sum"``): ``correct_count``, ``valid_count``.
    Default group: DP x CP (resolved at sync time). 0.0 while no valid token has been seen.

    Args:
        process_group: group to reduce over; ``None`` resolves to ``groups.dp_cp_group()`` at sync time.
        kwargs: further :class:`~torchmetrics.Metric` options.
    """

    higher_is_better: ClassVar[bool] = True

    def __init__(self, process_group: ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self._add_scalar_state("correct_count", 0.0, "sum")
        self._add_scalar_state("valid_count", 0.0, "sum")

    @override
    def update(self, correct_count: Tensor | float, valid_count: Tensor | float) -> None:
        """Add one micro-batch of this rank.

        Args:
            correct_count: scalar, this rank's valid target tokens whose arg-max logit is the target.
            valid_count: scalar, this rank's valid target tokens.
        """
        self.correct_count += self._as_scalar(correct_count, "correct_count")
        self.valid_count += self._as_scalar(valid_count, "valid_count")

    @override
    def compute(self) -> Tensor:
        return _safe_ratio(self.correct_count, self.valid_count)


class MeanTokenEntropy(_TokenMetric):
    """Mean entropy (nats) of the predicted next-token distribution over valid target tokens.

    States (float64, ``dist_reduce_fx="sum"``): ``entropy_sum``, ``valid_count``.
    Default group: DP x CP (resolved at sync time). 0.0 while no valid token has been seen.

    Args:
        process_group: group to reduce over; ``None`` resolves to ``groups.dp_cp_group()`` at sync time.
        kwargs: further :class:`~torchmetrics.Metric` options.
    """

    def __init__(self, process_group: ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self._add_scalar_state("entropy_sum", 0.0, "sum")
        self._add_scalar_state("valid_count", 0.0, "sum")

    @override
    def update(self, entropy_sum: Tensor | float, valid_count: Tensor | float) -> None:
        """Add one micro-batch of this rank.

        Args:
            entropy_sum: scalar, the sum of per-token entropies over this rank's valid target tokens.
            valid_count: scalar, the number of those tokens.
        """
        self.entropy_sum += self._as_scalar(entropy_sum, "entropy_sum")
        self.valid_count += self._as_scalar(valid_count, "valid_count")

    @override
    def compute(self) -> Tensor:
        return _safe_ratio(self.entropy_sum, self.valid_count)


class InputTokenCount(_TokenMetric):
    """Number of non-padding input tokens seen by the whole DP x CP group.

    State (float64, ``dist_reduce_fx="sum"``, exact up to 2**53): ``input_count``.
    Default group: DP x CP (resolved at sync time): each CP rank counts only its own slice.

    Args:
        process_group: group to reduce over; ``None`` resolves to ``groups.dp_cp_group()`` at sync time.
        kwargs: further :class:`~torchmetrics.Metric` options.
    """

    def __init__(self, process_group: ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self._add_scalar_state("input_count", 0.0, "sum")

    @override
    def update(self, input_count: Tensor | float) -> None:
        """Add one micro-batch of this rank.

        Args:
            input_count: scalar, this rank's non-padding input tokens.
        """
        self.input_count += self._as_scalar(input_count, "input_count")

    @override
    def compute(self) -> Tensor:
        return self.input_count.clone()


class TargetTokenCount(_TokenMetric):
    """Number of valid target tokens (tokens the loss is taken on) of the whole DP x CP group.

    State (float64, ``dist_reduce_fx="sum"``, exact up to 2**53): ``valid_count``; the same name
    and update argument as the ratio metrics, so one keyword ``valid_count`` feeds all of them.
    Default group: DP x CP (resolved at sync time).

    Args:
        process_group: group to reduce over; ``None`` resolves to ``groups.dp_cp_group()`` at sync time.
        kwargs: further :class:`~torchmetrics.Metric` options.
    """

    def __init__(self, process_group: ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self._add_scalar_state("valid_count", 0.0, "sum")

    @override
    def update(self, valid_count: Tensor | float) -> None:
        """Add one micro-batch of this rank.

        Args:
            valid_count: scalar, this rank's valid target tokens.
        """
        self.valid_count += self._as_scalar(valid_count, "valid_count")

    @override
    def compute(self) -> Tensor:
        return self.valid_count.clone()


class TokensPerSecond(_TokenMetric):
    """Throughput of the whole group: global non-padding input tokens per wall-clock second.

    States (float64): ``input_count`` (``dist_reduce_fx="sum"``) and ``seconds``
    (``dist_reduce_fx="max"``). On one rank ``seconds`` adds up the wall time of the steps counted;
    across ranks it is *not* summed, because the ranks run those steps at the same time: the group's
    wall time is that of its slowest rank, hence the max. Default group: DP x CP (resolved at sync time).
    0.0 while no time has been counted.

    ``full_state_update`` is on: the forward shortcut would merge step states with the
    cross-rank reduction (max), while seconds of successive steps on one rank must add up.

    Args:
        process_group: group to reduce over; ``None`` resolves to ``groups.dp_cp_group()`` at sync time.
        kwargs: further :class:`~torchmetrics.Metric` options.
    """

    full_state_update: ClassVar[bool] = True
    higher_is_better: ClassVar[bool] = True

    def __init__(self, process_group: ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        self._add_scalar_state("input_count", 0.0, "sum")
        self._add_scalar_state("seconds", 0.0, "max")

    @override
    def update(self, input_count: Tensor | float, seconds: Tensor | float) -> None:
        """Add one step of this rank.

        Args:
            input_count: scalar, this rank's non-padding input tokens in the step.
            seconds: wall-clock duration of the step on this rank.
        """
        self.input_count += self._as_scalar(input_count, "input_count")
        self.seconds += self._as_scalar(seconds, "seconds")

    @override
    def compute(self) -> Tensor:
        return _safe_ratio(self.input_count, self.seconds)


class SequencePerplexity(_GroupResolvingMetric):
    """A statistic of per-sequence perplexities ``exp(sequence NLL sum / sequence valid count)``.

    Long-context runs mix short and long sequences; the token-weighted :class:`TokenPerplexity` is
    dominated by the long ones, while this metric weighs every sequence once and exposes the spread.

    States (float64): ``ppl_sum`` and ``num_sequences`` (``dist_reduce_fx="sum"``), ``ppl_min``
    (``"min"``, starts at +inf), ``ppl_max`` (``"max"``, starts at -inf). Instances that differ only
    in ``statistic`` have the same states and share them inside a ``MetricCollection``.
    Default group: DP only (``groups.dp_group()``, resolved at sync time), because the inputs are
    totals already combined over CP (:func:`sequence_totals`) and identical on CP peers; reducing
    over DP x CP would count every sequence CP times.

    Args:
        statistic: ``"mean"``, ``"min"`` or ``"max"`` of the per-sequence perplexities (0.0 while no
            sequence has been seen), or ``"count"``, the number of sequences.
        process_group: group to reduce over; ``None`` resolves to ``groups.dp_group()`` at sync time.
        kwargs: further :class:`~torchmetrics.Metric` options.

    Raises:
        ValueError: if ``statistic`` is not one of the above.
    """

    higher_is_better: ClassVar[bool] = False
    _default_group = staticmethod(groups.dp_group)

    def __init__(
        self,
        statistic: SequenceStatistic = "mean",
        process_group: ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        if statistic not in _SEQUENCE_STATISTICS:
            raise ValueError(f"statistic must be one of {_SEQUENCE_STATISTICS}, got {statistic!r}")
        super().__init__(process_group=process_group, **kwargs)
        self.statistic = statistic
        self._add_scalar_state("ppl_sum", 0.0, "sum")
        self._add_scalar_state("num_sequences", 0.0, "sum")
        self._add_scalar_state("ppl_min", float("inf"), "min")
        self._add_scalar_state("ppl_max", float("-inf"), "max")

    @override
    def update(self, seq_nll_sum: Tensor, seq_valid_count: Tensor) -> None:
        """Add complete sequences; those with no valid target are skipped.

        Args:
            seq_nll_sum: ``[n]`` NLL sum of each sequence over all its valid targets (on every CP rank).
            seq_valid_count: ``[n]`` number of valid targets of each sequence.
        """
        if seq_nll_sum.ndim != 1 or seq_valid_count.shape != seq_nll_sum.shape:
            raise ValueError(
                f"seq_nll_sum and seq_valid_count must both be [n], got {tuple(seq_nll_sum.shape)} and "
                f"{tuple(seq_valid_count.shape)}; pass one total per sequence (see sequence_totals)"
            )
        nll = seq_nll_sum.detach().to(device=self.device, dtype=torch.float64)
        count = seq_valid_count.detach().to(device=self.device, dtype=torch.float64)
        present = count > 0
        ppl = _safe_ratio(nll, count).exp()
        # Masking with where() instead of boolean indexing keeps the update free of host syncs.
        self.ppl_sum += torch.where(present, ppl, 0.0).sum()
        self.num_sequences += present.sum()
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=self.device)
        self.ppl_min = torch.cat([self.ppl_min.view(1), torch.where(present, ppl, inf)]).amin()
        self.ppl_max = torch.cat([self.ppl_max.view(1), torch.where(present, ppl, -inf)]).amax()

    @override
    def compute(self) -> Tensor:
        if self.statistic == "count":
            return self.num_sequences.clone()
        if self.statistic == "mean":
            return _safe_ratio(self.ppl_sum, self.num_sequences)
        extreme = self.ppl_min if self.statistic == "min" else self.ppl_max
        return torch.where(self.num_sequences > 0, extreme, 0.0)
