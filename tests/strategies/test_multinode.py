"""Two nodes simulated on this machine: two ``torchrun`` agents (``--nnodes 2``, one per node rank, a static
rendezvous on localhost) of two gloo ranks each train as the same four ranks on one node do, and each CP group
stays inside a node (Megatron's order: TP fastest, then CP, then DP), as docs/usage.md's multi-node recipe says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.strategies import _two_nodes
from tests.test_cli import REPO

_TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_as_one_node_with_cp_groups_inside_each_node(world4, tmp_path):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    nodes = [
        subprocess.Popen(
            [
                *_TORCHRUN,
                "--nnodes=2",
                "--nproc-per-node=2",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "tests.strategies._two_nodes",
                str(tmp_path),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:  # a node that failed leaves the other waiting in the rendezvous
            node.kill()
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    one_node = world4.run(_two_nodes.fit, 1, 4)
    for rank, (two, one) in enumerate(zip(ranks, one_node, strict=True)):
        assert two["node"] == rank // 2
        assert two["cp"] == [2 * two["node"], 2 * two["node"] + 1]  # the node's two ranks
        assert two["dp"] == [rank % 2, rank % 2 + 2]  # across the nodes
        assert two["losses"] == pytest.approx(one["losses"], rel=1e-6)
