"""The language-model metrics the loss mixin logs: which ones (configurable), and how they are fed.

Every metric gets the same keyword totals of a micro-batch, computed from the loss pass itself (no
extra pass over the vocabulary); a ``torchmetrics.MetricCollection`` hands each metric the keywords its
``update`` names, so a user metric with, say, ``update(self, loss_sum, valid_count)`` fits in:

==================  ==========================================================================
``loss_sum``        this rank's NLL sum over its valid targets (fp32 scalar)
``valid_count``     this rank's number of valid targets
``correct_count``   of those, how many have the target as their arg-max
``entropy_sum``     sum of the predicted distributions' entropies over the valid targets
``input_count``     this rank's non-padding input tokens
``seq_nll_sum``     ``[n]`` NLL sum of every sequence of the micro-batch, complete (summed over CP)
``seq_valid_count`` ``[n]`` valid targets of every sequence, complete (summed over CP)
==================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection

from lightning_cp.constants import CP_SHARD, INPUT_MASK, LABELS
from lightning_cp.loss.metrics import (
    InputTokenCount,
    MeanTokenEntropy,
    MeanTokenLoss,
    SequencePerplexity,
    TargetTokenCount,
    TokenAccuracy,
    TokenPerplexity,
    sequence_totals,
)
from lightning_cp.ops import TokenStats
from lightning_cp.parallel.layout import ParallelLayout


def default_lm_metrics(stage: str) -> dict[str, Metric]:
    """The metrics logged under ``{stage}/``: ``loss``, ``ppl``, ``accuracy``, ``entropy``, ``target_tokens``,
    ``input_tokens``, ``seq_ppl_mean``, ``seq_ppl_min``, ``seq_ppl_max``.

    Training logs step values too, so its metrics synchronize in forward (every rank calls it).
    """
    sync = {"dist_sync_on_step": stage == "train"}
    return {
        "loss": MeanTokenLoss(**sync),
        "ppl": TokenPerplexity(**sync),
        "accuracy": TokenAccuracy(**sync),
        "entropy": MeanTokenEntropy(**sync),
        "target_tokens": TargetTokenCount(**sync),
        "input_tokens": InputTokenCount(**sync),
        "seq_ppl_mean": SequencePerplexity("mean", **sync),
        "seq_ppl_min": SequencePerplexity("min", **sync),
        "seq_ppl_max": SequencePerplexity("max", **sync),
    }


def lm_totals(stats: TokenStats, batch: Mapping[str, Tensor], layout: ParallelLayout) -> dict[str, Tensor]:
    """The keyword totals of the module docstring, from the loss's per-token statistics of this rank.

    ``batch`` is sharded (:func:`~lightning_cp.parallel.shard_batch`): its ``cp_shard`` says which
    sequence every local token belongs to.

    Communication: one all-reduce of ``2 * n`` float64 values over ``layout.cp_group`` (the per-sequence
    totals); every CP rank must call it.

    Raises:
        ValueError: ``batch`` has no ``cp_shard``.
    """
    shard = batch.get(CP_SHARD)
    if shard is None:
        raise ValueError(
            f"The loss metrics need a batch sharded by shard_batch, but this one has no {CP_SHARD!r} "
            f"(keys: {sorted(batch)}). Under MegatronCPStrategy every batch is sharded; without it, call "
            "lightning_cp.parallel.shard_batch(batch, 1, 0) first."
        )
    valid = stats.valid
    nll = stats.nll.detach()
    per_sequence = sequence_totals(
        torch.stack([nll.double(), valid.double()], dim=1),
        shard.sequence_index,
        shard.num_sequences,
        layout.cp_group,
    )
    return {
        "loss_sum": nll.sum(),
        "valid_count": valid.sum(),
        "correct_count": stats.correct.sum(),
        "entropy_sum": stats.entropy.sum(),
        "input_count": input_token_count(batch),
        "seq_nll_sum": per_sequence[:, 0],
        "seq_valid_count": per_sequence[:, 1],
    }


def input_token_count(batch: Mapping[str, Tensor]) -> Tensor:
    """This rank's non-padding input tokens (every token when the batch has no ``input_mask``)."""
    return batch[INPUT_MASK].sum() if INPUT_MASK in batch else torch.tensor(batch[LABELS].numel())


def as_collection(metrics: Mapping[str, Metric], prefix: str) -> MetricCollection:
    """``metrics`` as one collection logged under ``prefix`` (``"train/"``, ``"val/rl/"``, ...)."""
    return MetricCollection(dict(metrics), prefix=prefix)
