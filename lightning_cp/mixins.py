"""``CPLossMixin``: the CP-local fused loss for a ``LightningModule``, normalized once and for all ranks.

The objective is the mean loss over every valid target token of the global batch: all DP and CP
ranks and all gradient-accumulation micro-batches of an optimizer step (DESIGN.md, flow step 5).
Each rank only has its own tokens, so the mean cannot be taken locally (a CP-local mean is wrong as
soon as ranks hold different numbers of targets). Instead, with ``W = |DP x CP|`` ranks that DDP
averages over, and ``N`` the global number of valid targets:

    rank loss = W * local_sum / N        =>   DDP average of gradients = grad(global_sum) / N.

``N`` of a micro-batch is one scalar all-reduce. With gradient accumulation over ``A`` micro-batches
``N`` is only known after the last one, so every micro-batch of the step is divided by the first
micro-batch's count ``N_1`` and, just before the optimizer step, the gradients are multiplied by
``A * N_1 / (N_1 + ... + N_A)``: the ``A`` undoes Lightning's own division of the loss by
``accumulate_grad_batches`` (applied exactly once, here), the rest turns ``1 / N_1`` into ``1 / N``.
Without accumulation the factor is exactly 1 and nothing is rescaled.

This normalization is the only one in the package; the metrics (``lightning_cp.metrics``) are fed
from the same pass over the vocabulary (NLL, arg-max, entropy come out of the fused loss).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchmetrics import MetricCollection

from lightning_cp.metrics import (
    InputTokenCount,
    MeanTokenEntropy,
    MeanTokenLoss,
    SequencePerplexity,
    TargetTokenCount,
    TokenAccuracy,
    TokenPerplexity,
    TokensPerSecond,
    sequence_totals,
)
from lightning_cp.ops import TokenStats, cross_entropy, linear_cross_entropy
from lightning_cp.parallel import groups

_STAGES = {"train": "train", "validate": "val", "sanity_check": "val", "test": "test"}


def _all_reduce(value: Tensor, group: Any) -> Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, group=group)
    return value


def _make_metrics(stage: str) -> MetricCollection:
    # Training logs step values too, so its metrics synchronize in forward (every rank calls it).
    sync = {"dist_sync_on_step": stage == "train"}
    return MetricCollection(
        {
            "loss": MeanTokenLoss(**sync),
            "ppl": TokenPerplexity(**sync),
            "accuracy": TokenAccuracy(**sync),
            "entropy": MeanTokenEntropy(**sync),
            "target_tokens": TargetTokenCount(**sync),
            "input_tokens": InputTokenCount(**sync),
            "seq_ppl_mean": SequencePerplexity("mean", **sync),
            "seq_ppl_min": SequencePerplexity("min", **sync),
            "seq_ppl_max": SequencePerplexity("max", **sync),
        },
        prefix=f"{stage}/",
    )


class CPLossMixin:
    """Mix into a ``LightningModule`` to get the CP-local fused loss, its normalization and its metrics.

    Use it with ``class MyModel(CPLossMixin, LightningModule)`` (the mixin first) and return
    ``self.lm_loss(...)`` from ``training_step``. Under :class:`~lightning_cp.MegatronCPStrategy` the batch
    is already this rank's shard; without it (one process or plain DDP) the mixin works the same, with a
    batch from ``lightning_cp.parallel.shard_batch(batch, 1, 0)`` (labels shifted).

    Logged (``self.log``; step and epoch values in training, epoch values in validation / test), under
    ``train/``, ``val/`` and ``test/``: ``loss`` (token-weighted mean NLL), ``ppl``, ``accuracy`` (arg-max),
    ``entropy`` (mean per-token entropy), ``target_tokens``, ``input_tokens`` (non-padding),
    ``seq_ppl_mean`` / ``seq_ppl_min`` / ``seq_ppl_max`` (per-sequence perplexity over sequences), and in
    training ``train/tokens_per_sec``. Every value is reduced over DP x CP (per-sequence ones over DP after
    combining CP pieces), so it is the same for cp = 1, 2, 4.

    Gradient rescaling happens in ``on_before_optimizer_step``: if you override it, call ``super()``.
    Automatic optimization only (manual optimization has no ``accumulate_grad_batches`` division to undo).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Built with the module (not on first use): Lightning maps logged metric objects to attributes once.
        self._cp_metrics = nn.ModuleDict(
            {f"{stage}_metrics": _make_metrics(stage) for stage in ("train", "val", "test")}
        )
        self._cp_metrics["throughput"] = TokensPerSecond(dist_sync_on_step=True)
        self._cp_reference_count: Tensor | None = None
        self._cp_window_count: Tensor | None = None
        self._cp_last_step_time: float | None = None

    def lm_loss(
        self, hidden: Tensor, weight: Tensor, batch: Mapping[str, Tensor], **loss_kwargs: Any
    ) -> Tensor:
        """Fused LM head + cross-entropy on this rank's tokens, normalized for the global batch.

        Args:
            hidden: ``[B, S_local, H]`` final hidden states of this rank's tokens.
            weight: ``[V, H]`` LM-head weight, or this TP rank's ``[V / tp, H]`` shard when the weight is
                vocab-parallel: Megatron marks those with ``tensor_model_parallel = True``, which selects
                the TP path of the loss (a replicated weight under ``tp > 1`` is used as a whole).
            batch: the sharded batch (``labels`` ``[B, S_local]``; ``cu_seqlens`` when packed).
            **loss_kwargs: options of :func:`lightning_cp.ops.linear_cross_entropy` (``label_smoothing``,
                ``z_loss``, ``softcap``, ``chunk_size``, ``impl``).

        Returns:
            In training, the loss to back-propagate (``W * local_sum / N``, see the module docstring); in
            evaluation, the global token-mean loss (identical on every rank).

        Communication: one all-reduce of two scalars over DP x CP, the metric synchronization, and the
        TP all-reduces of the fused loss when ``tp > 1``.
        """
        loss_sum, stats = linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            weight,
            batch["labels"].reshape(-1),
            reduction="sum",
            return_stats=True,
            tp_group=_vocab_parallel_group(getattr(weight, "tensor_model_parallel", False)),
            **loss_kwargs,
        )
        return self._cp_objective(loss_sum, stats, batch)

    def lm_loss_from_logits(
        self, logits: Tensor, batch: Mapping[str, Tensor], *, vocab_parallel: bool = False, **loss_kwargs: Any
    ) -> Tensor:
        """As :meth:`lm_loss`, from logits ``[B, S_local, V]`` a model already produced (chunked fp32 upcast).

        Set ``vocab_parallel=True`` when ``logits`` is this TP rank's ``[B, S_local, V / tp]`` shard (the
        output of a column-parallel head); a tensor does not say so itself.
        """
        loss_sum, stats = cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            batch["labels"].reshape(-1),
            reduction="sum",
            return_stats=True,
            tp_group=_vocab_parallel_group(vocab_parallel),
            **loss_kwargs,
        )
        return self._cp_objective(loss_sum, stats, batch)

    def _cp_objective(self, loss_sum: Tensor, stats: TokenStats, batch: Mapping[str, Tensor]) -> Tensor:
        # One collective for both global totals: the count normalizes training, the sum is the eval loss.
        totals = torch.stack([stats.valid.sum().to(torch.float32), loss_sum.detach().float()])
        count, global_sum = _all_reduce(totals, groups.dp_cp_group()).unbind()
        self._update_lm_metrics(stats, batch)
        if not self._cp_is_training():
            return global_sum / count.clamp(min=1)
        if self._cp_reference_count is None:
            self._cp_reference_count = count.clamp(min=1)
            self._cp_window_count = torch.zeros_like(count)
        self._cp_window_count += count
        return loss_sum * groups.dp_cp_size() / self._cp_reference_count

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn the first micro-batch's normalizer into the whole step's (see the module docstring)."""
        reference = self._cp_reference_count
        accumulate = self.trainer.accumulate_grad_batches
        if reference is not None and accumulate > 1:
            factor = accumulate * reference / self._cp_window_count.clamp(min=1)
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor.to(param.grad.dtype))
        self._cp_reference_count = None
        super().on_before_optimizer_step(optimizer)  # type: ignore[misc]

    def _cp_is_training(self) -> bool:
        trainer = getattr(self, "_trainer", None)
        return trainer.training if trainer is not None else torch.is_grad_enabled()

    def _cp_stage(self) -> str | None:
        trainer = getattr(self, "_trainer", None)
        return (
            None if trainer is None else _STAGES.get(trainer.state.stage.value if trainer.state.stage else "")
        )

    def _update_lm_metrics(self, stats: TokenStats, batch: Mapping[str, Tensor]) -> None:
        stage = self._cp_stage()
        if stage is None:
            return
        valid = stats.valid
        nll = stats.nll.detach()
        sequence, num_sequences = _sequence_index(batch)
        per_sequence = sequence_totals(
            torch.stack([nll.double(), valid.double()], dim=1), sequence, num_sequences, groups.cp_group()
        )
        metrics = self._cp_metrics[f"{stage}_metrics"]  # "train" alone would clash with nn.Module.train
        inputs = batch["input_mask"].sum() if "input_mask" in batch else torch.tensor(valid.numel())
        sums = {
            "loss_sum": nll.sum(),
            "valid_count": valid.sum(),
            "correct_count": stats.correct.sum(),
            "entropy_sum": stats.entropy.sum(),
            "input_count": inputs,
            "seq_nll_sum": per_sequence[:, 0],
            "seq_valid_count": per_sequence[:, 1],
        }
        training = stage == "train"
        if training:
            metrics(**sums)  # forward: the step values Lightning logs on_step
            self._log_throughput(inputs)
        else:
            metrics.update(**sums)
        for name, metric in metrics.items():
            self.log(name, metric, on_step=training, on_epoch=True, prog_bar=name.endswith("/loss"))

    def _log_throughput(self, inputs: Tensor) -> None:
        now = time.perf_counter()
        last = self._cp_last_step_time
        self._cp_last_step_time = now
        if last is None:
            return
        throughput = self._cp_metrics["throughput"]
        throughput(input_count=inputs, seconds=now - last)
        self.log("train/tokens_per_sec", throughput, on_step=True, on_epoch=False)


def _vocab_parallel_group(vocab_parallel: bool) -> Any:
    """The TP group when the head is split over the vocabulary across more than one rank, else ``None``."""
    return groups.tp_group() if vocab_parallel and groups.tp_size() > 1 else None


def _sequence_index(batch: Mapping[str, Tensor]) -> tuple[Tensor, int]:
    """The sequence of every local token (row for padded batches, document for packed ones)."""
    labels = batch["labels"]
    if batch.get("cu_seqlens") is not None:
        cu = batch["cu_seqlens"].to(labels.device, torch.int64)
        lengths = cu[1:] - cu[:-1]
        return torch.repeat_interleave(torch.arange(len(lengths), device=labels.device), lengths), len(
            lengths
        )
    rows, local_len = labels.shape
    return torch.arange(rows, device=labels.device).repeat_interleave(local_len), rows
