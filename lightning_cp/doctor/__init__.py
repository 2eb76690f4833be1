"""``lightning-cp doctor``: does the package work on this machine, and which kernels does it pick?

- :mod:`~lightning_cp.doctor.environment`: versions, attention kernels, devices, the package's own choice of
  attention kernel and loss backend / chunk on the device at hand;
- :mod:`~lightning_cp.doctor.attention`: CP attention in each exchange (all-gather, in rounds, Ulysses) vs SDPA,
  and under bf16 autocast;
- :mod:`~lightning_cp.doctor.sparse`: a sparse attention layer (the indexer's top-k keys, the attention over
  them) vs the dense selection on each document;
- :mod:`~lightning_cp.doctor.mixers`: the hybrid mixers' adapted layers vs the layer on each document;
- :mod:`~lightning_cp.doctor.loss`: the fused loss and log-probabilities vs plain PyTorch on full logits, and
  under bf16 autocast with the dtype every matmul ran in (:mod:`~lightning_cp.doctor._autocast`);
- :mod:`~lightning_cp.doctor.tiling`: the package GPT tiled (``tile_model``) vs untiled;
- :mod:`~lightning_cp.doctor.collectives`: under ``torchrun``, the process group, ``GroupExchange``'s
  collectives, attention and the mixers across the real group, ``cpu_offload``'s ``cpu:gloo,cuda:nccl``
  exchange on CUDA, the ranks kept in step;
- :mod:`~lightning_cp.doctor._ranks`: the ranks a check runs, simulated in one process or this rank of a
  real group.

Every check is one :class:`CheckResult` line (``PASS`` / ``FAIL <error>`` / ``SKIP <why>``); the command
(:mod:`lightning_cp.cli.doctor`) prints them and exits with status 1 on any ``FAIL``.
"""

from lightning_cp.doctor._compare import CheckResult

__all__ = ["CheckResult"]
