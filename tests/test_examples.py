"""The example scripts run as a user runs them (``python examples/<script>.py``, CPU) and print what they claim.

The configs in ``examples/configs`` are run by ``tests/test_cli.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_cp.data import TokenFileDataset

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NUMBER = r"([-+]?\d+\.\d+(?:e[-+]\d+)?)"


def _run(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(("vocab_size", "dtype"), [(300, "uint16"), (70_000, "uint32")])
def test_make_token_file_writes_eos_separated_periodic_documents(tmp_path, vocab_size, dtype):
    path = tmp_path / "tokens.bin"
    out = _run(
        "make_token_file.py",
        str(path),
        "--num-docs",
        "50",
        "--min-len",
        "10",
        "--max-len",
        "40",
        "--period",
        "4",
        "--vocab-size",
        str(vocab_size),
        "--eos-id",
        "7",
    )
    tokens = np.fromfile(path, dtype=dtype)
    assert f"wrote 50 documents, {len(tokens)} tokens" in out and f"as {dtype} to {path}" in out
    sidecar = json.loads(path.with_name("tokens.bin.json").read_text())
    assert sidecar == {"dtype": dtype, "num_tokens": len(tokens), "vocab_size": vocab_size, "eos_id": 7}
    ends = np.flatnonzero(tokens == 7)
    assert len(ends) == 50 and ends[-1] == len(tokens) - 1
    documents = np.split(tokens, ends[:-1] + 1)
    lengths = [len(d) for d in documents]
    assert min(lengths) >= 10 and max(lengths) <= 40 and len(set(lengths)) > 5
    assert tokens.max() < vocab_size and tokens.max() > 0.9 * vocab_size  # the whole vocabulary is used
    for document in documents:
        body = document[:-1]
        np.testing.assert_array_equal(body[4:], body[:-4])  # the pattern of 4 ids repeats
    # The data module of configs/packed_sft_token_file.yaml reads it without a dtype: the sidecar has it.
    dataset = TokenFileDataset(path, seq_len=64, vocab_size=vocab_size, eos_id=7)
    assert [dataset[i]["input_ids"].tolist() for i in range(len(dataset))] == [d.tolist() for d in documents]


def test_make_token_file_rejects_impossible_lengths(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "make_token_file.py"),
            str(tmp_path / "x.bin"),
            "--min-len",
            "50",
            "--max-len",
            "40",
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--min-len 50 --max-len 40" in result.stderr
    assert not (tmp_path / "x.bin").exists()


def test_convert_to_cp_loss_mixin_gives_the_same_losses():
    out = _run("convert_to_cp_loss_mixin.py")
    rows = [
        tuple(map(float, m)) for m in re.findall(rf"^\s+\d+\s+{NUMBER}\s+{NUMBER}$", out, flags=re.MULTILINE)
    ]
    assert len(rows) == 6
    before, after = zip(*rows)
    assert after[0] == pytest.approx(before[0], abs=1e-5)  # same weights, same batch
    assert after == pytest.approx(before, abs=1e-4)  # and the same updates
    assert before[-1] < before[0] - 1.0  # it trains: the batch is being fitted


def test_rl_policy_loss_matches_materialized_logits_and_optimizes():
    out = _run("rl_policy_loss.py")
    check = re.search(
        rf"max \|logp diff\| {NUMBER}, max \|entropy diff\| {NUMBER}, max \|grad diff\| {NUMBER} "
        rf"\(grad scale {NUMBER}\)",
        out,
    )
    logp_diff, entropy_diff, grad_diff, grad_scale = map(float, check.groups())
    assert logp_diff < 1e-5 and entropy_diff < 1e-5 and grad_diff < 1e-5 * grad_scale
    steps = [
        dict(zip(("loss", "policy", "kl", "entropy", "clip_frac"), map(float, m)))
        for m in re.findall(
            rf"step \d+: loss {NUMBER}\s+policy {NUMBER}\s+kl {NUMBER}\s+entropy {NUMBER}\s+clip_frac {NUMBER}",
            out,
        )
    ]
    assert len(steps) == 3
    # Step 0: the policy is the sampling policy and the reference: ratio 1, nothing clipped, no KL.
    assert steps[0]["kl"] == 0 and steps[0]["clip_frac"] == 0
    assert steps[1]["kl"] > 0 and steps[2]["loss"] < steps[0]["loss"]
    assert 0 < steps[0]["entropy"] <= np.log(128)
