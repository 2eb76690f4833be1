"""Where consecutive runs of tokens start: the prefix sums every split, selection and gather uses.

Sequences (rows of a padded batch, documents of a packed one, a rank's pieces) sit one after the other in a
token dimension; their ``[n]`` lengths give where each starts (:func:`starts`, an exclusive prefix sum) and the
boundaries FlashAttention's varlen calls and packed batches take (:func:`boundaries`, ``cu_seqlens``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def starts(lengths: Tensor) -> Tensor:
    """``[n]``: where each of ``n`` consecutive runs of ``lengths`` ``[n]`` starts, ``[0, l0, l0 + l1, ...]``
    without the total; ``lengths``' dtype and device."""
    return torch.cumsum(lengths, 0) - lengths


def boundaries(lengths: Tensor) -> Tensor:
    """``[n + 1]`` int32: the boundaries of consecutive runs of ``lengths`` ``[n]``, ``[0, l0, l0 + l1, ...,
    total]`` (``cu_seqlens``); ``lengths``' device."""
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
