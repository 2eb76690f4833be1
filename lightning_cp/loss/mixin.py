"""``CPLossMixin``: the CP-local fused loss for a ``LightningModule``, normalized once for all ranks.

The mixin joins three pieces, each in its own module: the fused loss of this rank's tokens
(:mod:`lightning_cp.ops`), its normalization into the global token mean
(:class:`~lightning_cp.loss.objective.GlobalTokenObjective`), and the metrics fed from the same pass over the
vocabulary (:mod:`lightning_cp.loss.lm_metrics`, configurable with :meth:`CPLossMixin.configure_lm_metrics`).
The policy losses of reinforcement learning (:mod:`lightning_cp.loss.policy`) go through the same three.
Groups come from :func:`lightning_cp.parallel.current_layout` (the running strategy's layout).
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate
from torchmetrics import Metric

from lightning_cp.constants import LABELS
from lightning_cp.loss.lm_metrics import as_collection, default_lm_metrics, input_token_count, lm_totals
from lightning_cp.loss.metrics import TokensPerSecond
from lightning_cp.loss.objective import GlobalTokenObjective
from lightning_cp.loss.policy import PolicyObjective, default_policy_metrics, policy_terms
from lightning_cp.ops import (
    OutputHead,
    TokenStats,
    cross_entropy_with_stats,
    linear_cross_entropy_with_stats,
    token_logprobs,
    token_logprobs_with_entropy,
)
from lightning_cp.parallel.layout import ParallelLayout, current_layout

_STAGES = {"train": "train", "validate": "val", "sanity_check": "val", "test": "test"}


class CPLossMixin:
    """Mix into a ``LightningModule`` to get the CP-local fused loss, its normalization and its metrics.

    Use it with ``class MyModel(CPLossMixin, LightningModule)`` (the mixin first) and return
    ``self.lm_loss(...)`` from ``training_step``. Under :class:`~lightning_cp.MegatronCPStrategy` the batch
    is already this rank's shard; without it (one process or plain DDP) the mixin works the same, with a
    batch from ``lightning_cp.parallel.shard_batch(batch, 1, 0)`` (labels shifted).

    Logged (``self.log``; step and epoch values in training, epoch values in validation / test), under
    ``train/``, ``val/`` and ``test/``, by default: ``loss`` (token-weighted mean NLL), ``ppl``, ``accuracy``
    (arg-max), ``entropy`` (mean per-token entropy), ``target_tokens``, ``input_tokens`` (non-padding),
    ``seq_ppl_mean`` / ``seq_ppl_min`` / ``seq_ppl_max`` (per-sequence perplexity over the sequences that
    have targets; ``nan`` when none has), and in training ``train/tokens_per_sec``. Every value is reduced
    over DP x CP (per-sequence ones over DP after combining CP pieces), so it is the same for cp = 1, 2, 4.
    Override :meth:`configure_lm_metrics` to log fewer or more, and set ``log_tokens_per_sec = False`` to
    drop the throughput.

    Gradient rescaling happens in ``on_before_optimizer_step``: if you override it, call ``super()``.
    Automatic optimization only (manual optimization has no ``accumulate_grad_batches`` division to undo).
    """

    log_tokens_per_sec: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Built with the module (not on first use): Lightning maps logged metric objects to attributes once.
        self._cp_metrics = nn.ModuleDict()
        for stage in ("train", "val", "test"):
            self._cp_metrics[f"{stage}_metrics"] = as_collection(
                self.configure_lm_metrics(stage), f"{stage}/"
            )
            policy_metrics = as_collection(self.configure_policy_metrics(stage), f"{stage}/rl/")
            self._cp_metrics[f"{stage}_policy_metrics"] = policy_metrics
        # The same metrics over the micro-batches of the running optimizer step: the step values logged.
        self._cp_metrics["train_policy_step_metrics"] = copy.deepcopy(
            self._cp_metrics["train_policy_metrics"]
        )
        if self.log_tokens_per_sec:
            self._cp_metrics["throughput"] = TokensPerSecond(dist_sync_on_step=True)
        self._cp_objective = GlobalTokenObjective()
        self._cp_last_step_time: float | None = None

    def configure_lm_metrics(self, stage: str) -> Mapping[str, Metric]:
        """The metrics logged under ``{stage}/`` (``"train"``, ``"val"``, ``"test"``), by name.

        Called once per stage from ``__init__``. Override to log fewer (return ``{}`` for none) or to add
        your own: each metric's ``update`` receives the keyword totals it names (see
        :mod:`lightning_cp.loss.lm_metrics`). Training metrics should synchronize on step
        (``dist_sync_on_step=True``), since their step values are logged.
        """
        return default_lm_metrics(stage)

    def configure_policy_metrics(self, stage: str) -> Mapping[str, Metric]:
        """The metrics :meth:`policy_loss` logs under ``{stage}/rl/``, by name (default:
        :func:`~lightning_cp.loss.policy.default_policy_metrics`); each ``update`` receives the keyword totals it
        names from :class:`~lightning_cp.loss.policy.PolicyTerms` (a metric whose inputs a batch lacks, ``kl``
        without ``ref_logprobs``, is skipped). Called once per stage from ``__init__``. A training step value
        covers the whole optimizer step (every micro-batch of it: ``compute`` of a copy updated since the
        last optimizer step), so layouts that accumulate differently log the same step curves."""
        return default_policy_metrics()

    def lm_loss(
        self, hidden: Tensor, head: Tensor | OutputHead, batch: Mapping[str, Tensor], **loss_kwargs: Any
    ) -> Tensor:
        """Fused LM head + cross-entropy on this rank's tokens, normalized for the global batch.

        Args:
            hidden: ``[B, S_local, H]`` final hidden states of this rank's tokens.
            head: the LM head: an :class:`~lightning_cp.ops.OutputHead` (weight, bias, logit scale, final
                softcap; :func:`lightning_cp.hf.output_head` builds a ``transformers`` model's), or its bare
                ``[V, H]`` weight when the logits are ``hidden @ weight.T`` and nothing else. The weight (and
                bias) may be this TP rank's ``[V / tp, H]`` shard when vocab-parallel: Megatron marks those
                with ``tensor_model_parallel = True``, which selects the TP path of the loss (a replicated
                weight under ``tp > 1`` is used as a whole). An FSDP-sharded weight or bias (a ``DTensor``, as
                FSDP leaves a unit's parameters after its forward) is all-gathered for the loss and its
                gradient reduce-scattered back (averaged, as FSDP averages), so one unsharded copy of the
                head lives only while the loss runs.
            batch: the sharded batch (``labels`` ``[B, S_local]`` and ``cp_shard``, as ``shard_batch`` makes it).
            **loss_kwargs: options of :func:`lightning_cp.ops.linear_cross_entropy` (``label_smoothing``,
                ``z_loss``, ``chunk_size``, ``impl``; ``logit_scale`` and ``softcap`` only with a bare weight).

        Returns:
            In training, the loss to back-propagate (``W * local_sum / N``, see
            :mod:`lightning_cp.loss.objective`); in evaluation, the global token-mean loss (identical on every rank).

        Communication: one all-reduce of two scalars over DP x CP, the metric synchronization, and the
        TP all-reduces of the fused loss when ``tp > 1``; for a ``DTensor`` weight, its all-gather (and
        reduce-scatter in backward) over its mesh.

        Raises:
            ValueError: a bare weight that a model's probe marked as needing its head's transforms (pass
                the ``OutputHead``), or ``logit_scale`` / ``softcap`` given both here and on the head.
        """
        layout = current_layout()
        hidden, weight, labels, head_kwargs = _head_inputs(hidden, head, batch, layout, loss_kwargs)
        loss_sum, stats = linear_cross_entropy_with_stats(
            hidden, weight, labels, reduction="sum", **head_kwargs, **loss_kwargs
        )
        return self._cp_loss(loss_sum, stats, batch, layout)

    def lm_loss_from_logits(
        self, logits: Tensor, batch: Mapping[str, Tensor], *, vocab_parallel: bool = False, **loss_kwargs: Any
    ) -> Tensor:
        """As :meth:`lm_loss`, from logits ``[B, S_local, V]`` a model already produced (chunked fp32 upcast).

        Set ``vocab_parallel=True`` when ``logits`` is this TP rank's ``[B, S_local, V / tp]`` shard (the
        output of a column-parallel head); a tensor does not say so itself.
        """
        layout = current_layout()
        loss_sum, stats = cross_entropy_with_stats(
            logits.reshape(-1, logits.shape[-1]),
            batch[LABELS].reshape(-1),
            reduction="sum",
            tp_group=_vocab_parallel_group(layout, vocab_parallel),
            **loss_kwargs,
        )
        return self._cp_loss(loss_sum, stats, batch, layout)

    def policy_loss(
        self,
        hidden: Tensor,
        head: Tensor | OutputHead,
        batch: Mapping[str, Tensor],
        objective: PolicyObjective,
        **loss_kwargs: Any,
    ) -> Tensor:
        """A policy-gradient objective (PPO / GRPO / GSPO / Dr. GRPO) on this rank's rollout tokens, normalized
        for the global batch of the optimizer step (:mod:`lightning_cp.loss.policy` has the formulas).

        The per-token log-probabilities and entropies come from the fused head at ``objective.temperature``
        (no ``[tokens, vocab]`` logits). Logged under ``{stage}/rl/``: see :meth:`configure_policy_metrics`.

        Args:
            hidden: ``[B, S_local, H]`` final hidden states of this rank's tokens.
            head: as in :meth:`lm_loss`.
            batch: the sharded rollout batch: ``labels`` (the completion tokens; ``-100`` elsewhere),
                ``advantages``, optional ``old_logprobs`` and ``ref_logprobs``, each ``[B, S_local]`` and
                shifted with the labels by ``shard_batch`` (:class:`~lightning_cp.data.RolloutDataModule`
                makes such batches), and ``cp_shard``.
            objective: the objective (policy loss, clip bounds, ratio level, KL and entropy terms, aggregation,
                temperature).
            **loss_kwargs: ``chunk_size`` / ``impl`` of :func:`lightning_cp.ops.token_logprobs`.

        Returns:
            In training, the loss to back-propagate (``W * local_sum / Z``, :mod:`lightning_cp.loss.objective`
            with the aggregation's normalizer ``Z``); in evaluation, the objective of the global batch.

        Communication: one all-reduce of ``2 * n`` float64 values over the CP group (the ``n`` sequences'
        sums), one of two scalars over DP x CP, the metric synchronization; the head's as in :meth:`lm_loss`.

        Raises:
            ValueError: a batch without ``advantages`` / ``cp_shard``, or without ``ref_logprobs`` while
                ``objective.kl_coef > 0``; the head errors of :meth:`lm_loss`.
        """
        layout = current_layout()
        hidden, weight, labels, head_kwargs = _head_inputs(hidden, head, batch, layout, loss_kwargs)
        logprobs, entropy = token_logprobs_with_entropy(
            hidden, weight, labels, temperature=objective.temperature, **head_kwargs, **loss_kwargs
        )
        terms = policy_terms(logprobs, entropy, batch, objective, layout)
        normalizer, global_sum = GlobalTokenObjective.totals(terms.normalizer, terms.loss_sum, layout)
        self._log_policy_metrics(terms.totals, batch)
        if not self._cp_is_training():
            return global_sum / torch.where(normalizer > 0, normalizer, 1.0)
        return self._cp_objective.training_loss(terms.loss_sum, normalizer, layout)

    def lm_token_logprobs(
        self,
        hidden: Tensor,
        head: Tensor | OutputHead,
        batch: Mapping[str, Tensor],
        *,
        temperature: float = 1.0,
    ) -> dict[str, Tensor]:
        """Log-probability of every next token of this rank's shard, for ``predict_step``.

        Args: as :meth:`lm_loss` (an ``OutputHead`` or a bare weight; replicated, vocab-parallel or a ``DTensor``);
            ``temperature``: that of the distribution (a sampler's, for the old / reference log-probs of RL).

        Returns:
            ``{"logprobs": [B, S_local], "labels": [B, S_local]}`` (0 and ``-100`` where there is no target),
            what :class:`~lightning_cp.callbacks.TokenLogprobWriter` writes.

        Communication: the TP all-reduces of the fused head when the weight is vocab-parallel; a
        ``DTensor`` weight's all-gather.
        """
        hidden, weight, labels, head_kwargs = _head_inputs(hidden, head, batch, current_layout(), {})
        logprobs = token_logprobs(hidden, weight, labels, temperature=temperature, **head_kwargs)
        return {"logprobs": logprobs.view_as(batch[LABELS]), "labels": batch[LABELS]}

    def global_aux_loss(self, value: Tensor) -> Tensor:
        """The term to add to :meth:`lm_loss`'s result for an auxiliary loss of the whole global batch.

        ``value`` must already be the loss of every rank's tokens together, the same on every rank, with
        its gradient reaching this rank's tokens only (e.g. :func:`lightning_cp.hf.load_balancing_loss`
        over ``current_layout().loss_group``). In training it is weighted so that DDP's gradient average
        gives its gradient, and with gradient accumulation each micro-batch's value counts with its share
        of the step's target tokens (:mod:`lightning_cp.loss.objective`); call it after :meth:`lm_loss` in
        the same step. In evaluation it is ``value``. No communication.
        """
        if not self._cp_is_training():
            return value
        return self._cp_objective.auxiliary_loss(value, current_layout())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the first micro-batch's normalizer into the whole step's (see :mod:`lightning_cp.loss.objective`);
        the policy metrics' step values start over with the next step."""
        self._cp_objective.rescale_gradients(self.parameters(), self.trainer.accumulate_grad_batches)
        self._cp_metrics["train_policy_step_metrics"].reset()
        super().on_before_optimizer_step(optimizer)  # type: ignore[misc]

    def _cp_loss(
        self, loss_sum: Tensor, stats: TokenStats, batch: Mapping[str, Tensor], layout: ParallelLayout
    ) -> Tensor:
        # One collective for both global totals: the count normalizes training, the sum is the eval loss.
        count, global_sum = GlobalTokenObjective.totals(stats.valid.sum(), loss_sum, layout)
        self._log_lm_metrics(stats, batch, layout)
        if not self._cp_is_training():
            return global_sum / count.clamp(min=1)
        return self._cp_objective.training_loss(loss_sum, count, layout)

    def _cp_is_training(self) -> bool:
        trainer = getattr(self, "_trainer", None)
        return trainer.training if trainer is not None else torch.is_grad_enabled()

    def _cp_stage(self) -> str | None:
        trainer = getattr(self, "_trainer", None)
        if trainer is None or trainer.state.stage is None:
            return None
        return _STAGES.get(trainer.state.stage.value)

    def _log_lm_metrics(self, stats: TokenStats, batch: Mapping[str, Tensor], layout: ParallelLayout) -> None:
        stage = self._cp_stage()
        if stage is None:
            return
        metrics = self._cp_metrics[f"{stage}_metrics"]  # "train" alone would clash with nn.Module.train
        training = stage == "train"
        if len(metrics):
            totals = lm_totals(stats, batch, layout)
            if training:
                metrics(**totals)  # forward: the step values Lightning logs on_step
            else:
                metrics.update(**totals)
            for name, metric in metrics.items():
                self.log(name, metric, on_step=training, on_epoch=True, prog_bar=name.endswith("/loss"))
        if training and self.log_tokens_per_sec:
            self._log_throughput(input_token_count(batch))

    def _log_policy_metrics(self, totals: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> None:
        stage = self._cp_stage()
        if stage is None:
            return
        training = stage == "train"
        step_metrics = self._cp_metrics["train_policy_step_metrics"]
        for name, metric in self._cp_metrics[f"{stage}_policy_metrics"].items(keep_base=False):
            wanted = [key for key in inspect.signature(metric.update).parameters if key != "self"]
            if not set(wanted) <= set(totals):
                continue
            values = {key: totals[key] for key in wanted}
            metric.update(**values)
            shown = name.endswith("/loss")
            if not training:
                self.log(name, metric, on_epoch=True, prog_bar=shown)
                continue
            # The step value is the optimizer step's so far (every micro-batch of it, synchronized), where a
            # metric's forward would give this micro-batch's; Lightning logs the last micro-batch's call.
            step = step_metrics[name]
            step.update(**values)
            self.log(f"{name}_step", step.compute(), on_step=True, on_epoch=False, prog_bar=shown)
            self.log(f"{name}_epoch", metric, on_step=False, on_epoch=True)
        if training and self.log_tokens_per_sec:
            self._log_throughput(input_token_count(batch))

    def _log_throughput(self, inputs: Tensor) -> None:
        now = time.perf_counter()
        last = self._cp_last_step_time
        self._cp_last_step_time = now
        if last is None:
            return
        throughput = self._cp_metrics["throughput"]
        throughput(input_count=inputs, seconds=now - last)
        self.log("train/tokens_per_sec", throughput, on_step=True, on_epoch=False)


def _vocab_parallel_group(layout: ParallelLayout, vocab_parallel: bool) -> Any:
    """The TP group when the head is split over the vocabulary across more than one rank, else ``None``."""
    return layout.tp_group if vocab_parallel else None


_HEAD_OPTIONS = ("logit_scale", "softcap")


def _head_inputs(
    hidden: Tensor,
    head: Tensor | OutputHead,
    batch: Mapping[str, Tensor],
    layout: ParallelLayout,
    loss_kwargs: Mapping[str, Any],
) -> tuple[Tensor, Tensor, Tensor, dict[str, Any]]:
    """The fused head's arguments: ``hidden`` ``[N, H]``, the (unsharded) ``weight``, ``labels`` ``[N]`` and
    the head's keywords: its (unsharded) ``bias`` and transforms, and the TP group when Megatron marks the
    weight as this rank's vocabulary shard (``tensor_model_parallel``)."""
    if isinstance(head, OutputHead):
        given = sorted(set(_HEAD_OPTIONS) & set(loss_kwargs))
        if given:
            raise ValueError(
                f"{', '.join(given)} given both to lm_loss and on the OutputHead "
                f"(logit_scale={head.logit_scale}, softcap={head.softcap}); set them on the OutputHead only."
            )
        transforms = {"bias": head.bias, "logit_scale": head.logit_scale, "softcap": head.softcap}
    else:
        OutputHead.check_bare_weight(head)
        head, transforms = OutputHead(head), {}
    if transforms.get("bias") is not None:
        transforms["bias"] = _unsharded(transforms["bias"], hidden.device)
    vocab_parallel = getattr(head.weight, "tensor_model_parallel", False)
    kwargs = {"tp_group": _vocab_parallel_group(layout, vocab_parallel), **transforms}
    weight = _unsharded(head.weight, hidden.device)
    return hidden.reshape(-1, hidden.shape[-1]), weight, batch[LABELS].reshape(-1), kwargs


def _unsharded(weight: Tensor, device: torch.device) -> Tensor:
    """The full tensor of a ``DTensor`` weight on ``device``, whose gradient flows back reduce-scattered and
    averaged.

    ``full_tensor()`` alone would hand each rank's own gradient back as a replicated one (sliced, not
    reduced); declaring the gradient ``Partial("avg")`` makes autograd reduce-scatter it over the mesh. A
    shard in host memory (FSDP's CPU offload) is copied to ``device`` first, so the gather runs there and
    the reduced gradient shard is copied back to the host.
    """
    if not isinstance(weight, DTensor):
        return weight
    mesh = weight.device_mesh
    return (
        weight.to(device)
        .redistribute(mesh, [Replicate()] * mesh.ndim)
        .to_local(grad_placements=[Partial("avg")] * mesh.ndim)
    )
