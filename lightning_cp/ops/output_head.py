"""``OutputHead``: an LM head as the fused loss applies it, ``softcap(logit_scale * (hidden @ weight.T + bias))``.

Most heads are a bare weight; some models transform the logits after it: Phi's ``lm_head`` has a bias,
Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``, Gemma-2 caps with
``final_logit_softcapping``. A weight alone would train those models on another objective, so the loss
takes the whole head (:meth:`lightning_cp.CPLossMixin.lm_loss` accepts an ``OutputHead`` in place of the
weight; :func:`lightning_cp.hf.output_head` builds one from a ``transformers`` model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Set on a weight whose model applies more than ``hidden @ weight.T`` (see OutputHead.mark_weight).
_TRANSFORMS_ATTRIBUTE = "lightning_cp_output_transforms"


@dataclass(frozen=True)
class OutputHead:
    """The logits ``softcap * tanh(logit_scale * (hidden @ weight.T + bias) / softcap)`` of an LM head.

    Args:
        weight: ``[V, H]`` output embedding (or this TP rank's ``[V / tp, H]`` vocabulary shard, or an
            FSDP ``DTensor``: :meth:`~lightning_cp.CPLossMixin.lm_loss` treats it as it treats a bare weight).
        bias: ``[V]`` bias of the head (sharded like ``weight``), or ``None``.
        logit_scale: positive multiplier of the logits (Cohere's ``logit_scale``; a divisor ``d`` such as
            Granite's ``logits_scaling`` is ``1 / d``).
        softcap: final logit softcapping (Gemma-2's ``final_logit_softcapping``), or ``None``.

    Raises:
        ValueError / TypeError: a weight that is not a 2-D float tensor, a bias that does not fit it, a
            ``logit_scale`` or ``softcap`` that is not a positive finite number.
    """

    weight: Tensor
    bias: Tensor | None = None
    logit_scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.weight, Tensor)
            or self.weight.dim() != 2
            or not self.weight.is_floating_point()
        ):
            raise TypeError(f"OutputHead.weight must be a 2-D float tensor [V, H], got {self.weight!r}.")
        if self.bias is not None and (
            not isinstance(self.bias, Tensor) or self.bias.shape != self.weight.shape[:1]
        ):
            shape = tuple(self.bias.shape) if isinstance(self.bias, Tensor) else type(self.bias).__name__
            raise ValueError(
                f"OutputHead.bias must be a tensor [V] = [{self.weight.shape[0]}] like the weight's rows, got {shape}."
            )
        for name in ("logit_scale", "softcap"):
            value = getattr(self, name)
            if value is None and name == "softcap":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"OutputHead.{name} must be a positive finite number, got {value!r}.")

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, logit_scale: float = 1.0, softcap: float | None = None
    ) -> OutputHead:
        """The head of an ``nn.Linear`` (its weight and, if it has one, its bias) with these transforms."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"OutputHead.from_linear takes a torch.nn.Linear, got {type(linear).__name__}.")
        return cls(linear.weight, linear.bias, logit_scale, softcap)

    @property
    def is_plain(self) -> bool:
        """Whether the logits are ``hidden @ weight.T`` and nothing else."""
        return self.bias is None and self.logit_scale == 1.0 and self.softcap is None

    def logits(self, hidden: Tensor) -> Tensor:
        """The materialized fp32 logits ``[..., V]`` of ``hidden`` ``[..., H]`` (for checks and small vocabularies;
        the losses never build them)."""
        z = hidden @ self.weight.t()
        if self.bias is not None:
            z = z + self.bias
        z = z.float() * self.logit_scale
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)

    def describe(self) -> str:
        """The transforms after the matmul, e.g. ``"bias, logit_scale=0.0625"`` (``"none"`` for a plain head)."""
        parts = ["bias"] if self.bias is not None else []
        parts += [f"logit_scale={self.logit_scale:g}"] if self.logit_scale != 1.0 else []
        parts += [f"softcap={self.softcap:g}"] if self.softcap is not None else []
        return ", ".join(parts) or "none"

    def mark_weight(self, owner: str) -> None:
        """Record on the weight tensor that ``owner``'s logits need this head, not the weight alone.

        :meth:`check_bare_weight` then refuses the weight where a loss would use it without the transforms.
        A plain head clears the record.
        """
        if self.is_plain:
            self.weight.__dict__.pop(_TRANSFORMS_ATTRIBUTE, None)
        else:
            setattr(self.weight, _TRANSFORMS_ATTRIBUTE, f"{owner} (its logits apply {self.describe()})")

    @staticmethod
    def check_bare_weight(weight: Tensor) -> None:
        """Raise if ``weight`` was marked (:meth:`mark_weight`) as needing transforms a bare weight loses."""
        owner = getattr(weight, _TRANSFORMS_ATTRIBUTE, None)
        if owner is not None:
            raise ValueError(
                f"This LM-head weight belongs to {owner}: the loss of the weight alone would train another "
                "objective. Pass the whole head instead of the weight: lightning_cp.hf.output_head(model) for a "
                "transformers model, or lightning_cp.ops.OutputHead(weight, bias, logit_scale, softcap)."
            )
