"""A check's result line, and the tolerance rule every numerical check of the doctor uses.

A result is compared to a float64 reference computed on the CPU from the same (rounded) inputs. The
tolerance is relative to what PyTorch itself achieves in the same dtype on the same device (SDPA,
``F.cross_entropy``): ``min(2 * torch_error + floor[dtype], 1e-2)``. Low precision therefore passes where
PyTorch's own kernels would, and an error of 1% always fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

Status = Literal["PASS", "FAIL", "SKIP"]

MAX_TOLERANCE = 1e-2
"""No tolerance is larger: a 1% error fails whatever the dtype."""
_FLOOR = {torch.float32: 1e-5, torch.bfloat16: 1e-3}
"""Added to twice PyTorch's own error: the rounding a correct kernel may add on top of PyTorch's."""


@dataclass(frozen=True)
class CheckResult:
    """One line of the doctor's report."""

    name: str
    """What was checked, e.g. ``attention cp=2 padded gqa bfloat16``."""
    status: Status
    detail: str = ""
    """The measured error and tolerance (PASS, FAIL) or why the check did not run (SKIP)."""

    def line(self) -> str:
        return f"{self.status}  {self.name}" + (f"  {self.detail}" if self.detail else "")


def run_check(name: str, check: Callable[..., CheckResult], *args: Any) -> CheckResult:
    """``check(name, *args)``, or a FAIL named ``name`` with the exception it raised (its first line)."""
    try:
        return check(name, *args)
    except Exception as error:  # noqa: BLE001  (any failure is this check's FAIL line; the others still run)
        return CheckResult(name, "FAIL", error_line(error))


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: how a line names a dtype."""
    return str(dtype).removeprefix("torch.")


def error_line(error: BaseException) -> str:
    """``Type: the first line of the message``, at most 300 characters: a FAIL line's detail."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0] if message else ''}"[:300]


def relative_error(got: Tensor, want: Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (``||got||`` when ``want`` is 0)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        raise ValueError(f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    scale = want.norm() if bool(want.any()) else torch.ones((), dtype=torch.float64)
    return float((got - want).norm() / scale)


def tolerance(dtype: torch.dtype, torch_error: float) -> float:
    """The largest relative error accepted for a result in ``dtype`` where PyTorch's own is ``torch_error``."""
    return min(MAX_TOLERANCE, 2 * torch_error + _FLOOR[dtype])


def compare(
    name: str,
    dtype: torch.dtype,
    results: Mapping[str, tuple[Tensor, Tensor, Tensor]],
    note: str = "",
) -> CheckResult:
    """PASS when every quantity is within :func:`tolerance`, else FAIL naming the worst one.

    Args:
        name: the check's name.
        dtype: the dtype the results were computed in (selects the floor).
        results: ``{"out": (ours, reference, torch's), ...}``: our result, the float64 reference and
            PyTorch's own computation in ``dtype``.
        note: appended to the detail (e.g. the kernel that ran).
    """
    if not results:
        raise ValueError(f"{name}: nothing to compare")
    worst: tuple[float, str, float, float] | None = None  # (error / tolerance, quantity, error, tolerance)
    for quantity, (ours, reference, torchs) in results.items():
        error = relative_error(ours, reference)
        limit = tolerance(dtype, relative_error(torchs, reference))
        if math.isnan(error):
            return CheckResult(name, "FAIL", f"{quantity} is NaN {note}".strip())
        if worst is None or error / limit > worst[0]:
            worst = (error / limit, quantity, error, limit)
    _, quantity, error, limit = worst
    detail = f"worst {quantity}: rel err {error:.1e} {'<=' if error <= limit else '>'} tol {limit:.1e} {note}"
    return CheckResult(name, "PASS" if error <= limit else "FAIL", detail.strip())
