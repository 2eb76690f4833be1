"""``lightning-cp doctor``: does the package work on this machine, and which kernels does it pick?

- :mod:`~lightning_cp.doctor.environment`: versions, attention kernels, devices, the package's own choice of
  attention kernel and loss backend / chunk on the device at hand;
- :mod:`~lightning_cp.doctor.attention`: CP attention of simulated groups of 2 and 4 ranks vs SDPA;
- :mod:`~lightning_cp.doctor.loss`: the fused loss and log-probabilities vs plain PyTorch on full logits;
- :mod:`~lightning_cp.doctor.collectives`: under ``torchrun``, the process group, ``GroupExchange``'s
  collectives and CP attention across the real group.

Every check is one :class:`CheckResult` line (``PASS`` / ``FAIL <error>`` / ``SKIP <why>``); the command
(:mod:`lightning_cp.cli.doctor`) prints them and exits with status 1 on any ``FAIL``.
"""

from lightning_cp.doctor._compare import CheckResult

__all__ = ["CheckResult"]
