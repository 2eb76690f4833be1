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
- Of a policy objective (:mod:`lightning_cp.loss.policy`): :class:`PolicyLoss` and
  :class:`PolicySurrogateLoss` (``update(objective_sum | surrogate_sum, objective_normalizer)``, as trained),
  :class:`ClipFraction`, :class:`MeanRatio`, :class:`MeanTokenKL` (``update(clipped_count | ratio_sum |
  kl_sum, valid_count)``) and :class:`MeanCompletionLength` (``update(valid_count, sequence_count)``).

Sequence-level metric, fed with per-sequence totals already combined over CP (see
:func:`sequence_totals`), reduced over DP only by default:

- :class:`SequencePerplexity`: ``update(seq_nll_sum, seq_valid_count)``; ``statistic`` picks the
  mean, min or max of the per-sequence perplexities, or the number of sequences.

The default group is resolved from :func:`~lightning_cp.parallel.current_layout` when the metric
synchronizes, not when it is built: metrics are usually created in a ``LightningModule.__init__``, before
the strategy has created its groups. Without the strategy both defaults are the world group (plain DDP),
and a group of one rank (a single process, or ``cp=1`` for per-sequence metrics with ``dp=1``) means no
synchronization.

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

import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_cp.parallel.layout import ParallelLayout, ProcessGroup, current_layout

SequenceStatistic = Literal["mean", "min", "max", "count"]
_SEQUENCE_STATISTICS: tuple[str, ...] = ("mean", "min", "max", "count")

__all__ = [
    "ClipFraction",
    "InputTokenCount",
    "MeanCompletionLength",
    "MeanRatio",
    "MeanTokenEntropy",
    "MeanTokenKL",
    "MeanTokenLoss",
    "PolicyLoss",
    "PolicySurrogateLoss",
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
        cp_group: the group whose partial sums are added (``layout.cp_group``). Unlike the
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
    """Base of every metric here: a default group resolved at sync time, and float64 states.

    ``sync`` is the public hook that ``compute()`` goes through before reducing states, so it is
    where a missing ``process_group`` is replaced by the default group of the current layout: by then the
    strategy has set it up, which it had not when the metric was constructed. A group of ``None`` (a
    dimension of size 1) means no synchronization.
    """

    is_differentiable: ClassVar[bool] = False
    full_state_update: ClassVar[bool] = False
    _default_group: ClassVar[Callable[[ParallelLayout], ProcessGroup | None]]

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
            process_group = self.process_group
        if process_group is None:
            process_group = type(self)._default_group(current_layout())
            should_sync = should_sync and process_group is not None
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


class _Totals(_GroupResolvingMetric):
    """A metric computed from scalar totals of this rank's tokens, summed (or maxed) over DP x CP.

    A subclass declares ``totals``: each update argument, which is also the name of its float64 state,
    with the reduction across ranks. ``update`` takes exactly those arguments (by position or keyword)
    and adds them to the states; ``compute`` turns the reduced states into the value. Default group:
    ``layout.loss_group`` (DP x CP), resolved at sync time; TP peers hold the same totals and are not in it.

    Args:
        process_group: group to reduce over; ``None`` resolves to ``layout.loss_group`` at sync time.
        kwargs: further :class:`~torchmetrics.Metric` options (``sync_on_compute``, ...).
    """

    totals: ClassVar[dict[str, str]]
    _default_group = staticmethod(lambda layout: layout.loss_group)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "totals" not in cls.__dict__:
            return
        parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Tensor | float")
            for name in cls.totals
        ]
        signature = inspect.Signature(parameters)

        def update(self: _Totals, *args: Any, **kwargs: Any) -> None:
            for name, value in list(signature.bind(self, *args, **kwargs).arguments.items())[1:]:
                setattr(self, name, getattr(self, name) + self._as_scalar(value, name))

        # A real signature: MetricCollection hands each metric only the keywords its update names.
        update.__signature__ = signature  # type: ignore[attr-defined]
        update.__doc__ = f"Add this rank's totals of one micro-batch (scalars): {', '.join(cls.totals)}."
        cls.update = update  # type: ignore[method-assign]

    def __init__(self, process_group: ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(process_group=process_group, **kwargs)
        for name, reduce_fx in self.totals.items():
            self._add_scalar_state(name, 0.0, reduce_fx)


class _Ratio(_Totals):
    """A :class:`_Totals` whose value is its first total over its second (0.0 while the second is 0)."""

    @override
    def compute(self) -> Tensor:
        numerator, denominator = self.totals
        return _safe_ratio(getattr(self, numerator), getattr(self, denominator))


class MeanTokenLoss(_Ratio):
    """Mean negative log-likelihood per valid target token of the global batch.

    ``update(loss_sum, valid_count)``: this rank's NLL sum over its valid targets and their number.
    ``compute()`` is ``sum(loss_sum) / sum(valid_count)`` over DP x CP: the token-weighted mean, which a
    mean of per-rank means is not when ranks hold different numbers of targets. 0.0 before any target.
    """

    totals: ClassVar[dict[str, str]] = {"loss_sum": "sum", "valid_count": "sum"}
    higher_is_better: ClassVar[bool] = False


class TokenPerplexity(MeanTokenLoss):
    """Perplexity of the global batch: ``exp`` of :class:`MeanTokenLoss` (same update and states).

    The logged perplexity is always the exponential of the logged loss; ``exp(0.0) = 1.0`` before any target.
    """

    @override
    def compute(self) -> Tensor:
        return super().compute().exp()


class TokenAccuracy(_Ratio):
    """Fraction of valid target tokens whose arg-max prediction is the target.

    ``update(correct_count, valid_count)``; 0.0 before any target.
    """

    totals: ClassVar[dict[str, str]] = {"correct_count": "sum", "valid_count": "sum"}
    higher_is_better: ClassVar[bool] = True


class MeanTokenEntropy(_Ratio):
    """Mean entropy (nats) of the predicted next-token distribution over valid target tokens.

    ``update(entropy_sum, valid_count)``; 0.0 before any target.
    """

    totals: ClassVar[dict[str, str]] = {"entropy_sum": "sum", "valid_count": "sum"}


class PolicyLoss(_Ratio):
    """A policy objective of the global batch as it is trained (:mod:`lightning_cp.loss.policy`): its
    numerator over its normalizer (targets or sequences), ``update(objective_sum, objective_normalizer)``."""

    totals: ClassVar[dict[str, str]] = {"objective_sum": "sum", "objective_normalizer": "sum"}
    higher_is_better: ClassVar[bool] = False


class PolicySurrogateLoss(_Ratio):
    """The clipped-surrogate part of :class:`PolicyLoss`, aggregated alike: ``update(surrogate_sum,
    objective_normalizer)``."""

    totals: ClassVar[dict[str, str]] = {"surrogate_sum": "sum", "objective_normalizer": "sum"}
    higher_is_better: ClassVar[bool] = False


class ClipFraction(_Ratio):
    """Share of the target tokens whose clipped term the policy objective takes (their gradient is zero):
    ``update(clipped_count, valid_count)``."""

    totals: ClassVar[dict[str, str]] = {"clipped_count": "sum", "valid_count": "sum"}


class MeanRatio(_Ratio):
    """Mean importance ratio ``pi / pi_old`` over the target tokens: ``update(ratio_sum, valid_count)``."""

    totals: ClassVar[dict[str, str]] = {"ratio_sum": "sum", "valid_count": "sum"}


class MeanTokenKL(_Ratio):
    """Mean per-token KL estimate to the reference model over the target tokens: ``update(kl_sum, valid_count)``."""

    totals: ClassVar[dict[str, str]] = {"kl_sum": "sum", "valid_count": "sum"}
    higher_is_better: ClassVar[bool] = False


class MeanCompletionLength(_Ratio):
    """Mean number of target tokens per sequence that has any: ``update(valid_count, sequence_count)``, with
    each sequence counted by one rank of its CP group."""

    totals: ClassVar[dict[str, str]] = {"valid_count": "sum", "sequence_count": "sum"}


class InputTokenCount(_Totals):
    """Non-padding input tokens seen by the whole DP x CP group (``update(input_count)``; exact to 2**53)."""

    totals: ClassVar[dict[str, str]] = {"input_count": "sum"}

    @override
    def compute(self) -> Tensor:
        return self.input_count.clone()


class TargetTokenCount(_Totals):
    """Valid target tokens (the tokens the loss is taken on) of the whole DP x CP group (``update(valid_count)``)."""

    totals: ClassVar[dict[str, str]] = {"valid_count": "sum"}

    @override
    def compute(self) -> Tensor:
        return self.valid_count.clone()


class TokensPerSecond(_Totals):
    """Throughput of the whole group: global non-padding input tokens per wall-clock second.

    ``update(input_count, seconds)`` per step. ``seconds`` add up on one rank but are *maxed* across ranks,
    which run their steps at the same time: the group's wall time is that of its slowest rank. 0.0 before
    any time is counted. ``full_state_update`` is on: the forward shortcut would merge step states with the
    cross-rank reduction (max), while seconds of successive steps on one rank must add up.
    """

    totals: ClassVar[dict[str, str]] = {"input_count": "sum", "seconds": "max"}
    full_state_update: ClassVar[bool] = True
    higher_is_better: ClassVar[bool] = True

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
    Default group: DP only (``layout.dp_group``, resolved at sync time), because the inputs are
    totals already combined over CP (:func:`sequence_totals`) and identical on CP peers; reducing
    over DP x CP would count every sequence CP times.

    Args:
        statistic: ``"mean"``, ``"min"`` or ``"max"`` of the per-sequence perplexities, or ``"count"``,
            the number of sequences. Sequences without any valid target have no perplexity and are not
            counted; before the first counted sequence every statistic is ``nan`` (nothing to report),
            except ``"count"``, which is 0.
        process_group: group to reduce over; ``None`` resolves to ``layout.dp_group`` at sync time.
        kwargs: further :class:`~torchmetrics.Metric` options.

    Raises:
        ValueError: if ``statistic`` is not one of the above.
    """

    higher_is_better: ClassVar[bool] = False
    _default_group = staticmethod(lambda layout: layout.dp_group)

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
        seen = self.num_sequences > 0
        nan = torch.full_like(self.ppl_sum, float("nan"))
        if self.statistic == "mean":
            return torch.where(seen, self.ppl_sum / self.num_sequences.clamp(min=1), nan)
        return torch.where(seen, self.ppl_min if self.statistic == "min" else self.ppl_max, nan)
