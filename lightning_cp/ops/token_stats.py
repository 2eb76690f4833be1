"""Per-token statistics of the softmax of the logits, the byproducts of every loss pass of :mod:`lightning_cp.ops`.

``linear_cross_entropy_with_stats``, ``cross_entropy_with_stats`` return them next to the loss; the
metrics of :mod:`lightning_cp.loss` read them. How a backend's partials merge into them over vocabulary
shards is private (``ops._partials``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenStats:
    """Per-token statistics of the softmax of the (softcapped) logits; all ``[n]``, detached.

    They are byproducts of the loss pass (no extra pass over the vocabulary). The metrics (loss,
    perplexity, accuracy, entropy) read :attr:`nll`, :attr:`correct`, :attr:`entropy` and :attr:`valid`
    and sum them over valid tokens. The same type holds the statistics of one chunk of tokens
    (``ops._partials.merge``) and of the whole input (:meth:`empty`, filled chunk by chunk with :meth:`write`).
    """

    labels: torch.Tensor
    """int64 global vocabulary ids of the targets (``ignore_index`` where ignored)."""
    valid: torch.Tensor
    """bool: the label is not ``ignore_index``."""
    lse: torch.Tensor
    """fp32 ``log sum_j exp(s_j)`` over the full (all-shard) vocabulary."""
    target: torch.Tensor
    """fp32 ``s[label]``; 0 at ignored tokens."""
    argmax: torch.Tensor
    """int64 global vocabulary id of the first maximal logit."""
    entropy: torch.Tensor | None
    """fp32 entropy of the softmax (nats), 0 at ignored tokens; ``None`` when not asked for."""
    total: torch.Tensor | None
    """fp32 ``sum_j s_j`` over the full vocabulary; only kept for label smoothing."""

    @property
    def nll(self) -> torch.Tensor:
        """fp32 ``-log p(label)``, without label smoothing or z-loss; 0 at ignored tokens."""
        return torch.where(self.valid, self.lse - self.target, 0.0)

    @property
    def correct(self) -> torch.Tensor:
        """bool: the first arg-max of the logits is the label; False at ignored tokens."""
        return (self.argmax == self.labels) & self.valid

    @classmethod
    def empty(
        cls, labels: torch.Tensor, valid: torch.Tensor, *, entropy: bool, smoothing: bool
    ) -> TokenStats:
        """Uninitialized statistics for the tokens of ``labels`` ``[N]``, to :meth:`write` chunk by chunk."""

        def vec() -> torch.Tensor:
            return torch.empty(labels.shape, dtype=torch.float32, device=labels.device)

        return cls(
            labels=labels,
            valid=valid,
            lse=vec(),
            target=vec(),
            argmax=torch.empty(labels.shape, dtype=torch.int64, device=labels.device),
            entropy=vec() if entropy else None,
            total=vec() if smoothing else None,
        )

    def write(self, start: int, stop: int, chunk: TokenStats) -> None:
        """Copy the statistics of the chunk of tokens ``[start, stop)``."""
        for name in ("lse", "target", "argmax", "entropy", "total"):
            mine = getattr(self, name)
            if mine is not None:
                mine[start:stop] = getattr(chunk, name)
