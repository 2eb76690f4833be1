"""The plan's headline figures that README.md and docs/plan.md state, recomputed from the code.

A change to a term of the plan that moves Llama-3-8B's or Llama-3-70B's longest sequence, or the best peak
of Llama-3-8B at 1M tokens, fails here until the documents are regenerated.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_cp.cli.plan import main

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "configs" / "models"
README = (ROOT / "README.md").read_text()
PLAN_DOC = (ROOT / "docs" / "plan.md").read_text()


def _plan(capsys: pytest.CaptureFixture, model: str, *argv: str) -> str:
    assert main([str(MODELS / model), "--gpu-memory", "80GB", *argv]) == 0
    return capsys.readouterr().out


def _flat(text: str) -> str:
    """The text with its line breaks and emphasis removed, as a sentence reads."""
    return re.sub(r"\s+", " ", text.replace("**", ""))


def _longest(out: str) -> int:
    return int(re.search(r"longest sequence on .*: ([\d,]+) tokens", out)[1].replace(",", ""))


@pytest.mark.parametrize(
    ("model", "gpus", "phrases"),
    [
        ("llama3_8b.json", 8, ["Llama-3-8B {m} tokens", "at most {m} tokens"]),
        ("llama3_70b.json", 64, ["Llama-3-70B {m} on 64 H100", "at most {m} tokens (per GPU"]),
    ],
    ids=["llama3-8b", "llama3-70b"],
)
def test_the_longest_sequences_stated_are_the_plan_s(
    capsys: pytest.CaptureFixture, model: str, gpus: int, phrases: list[str]
) -> None:
    millions = f"{_longest(_plan(capsys, model, '--gpus', str(gpus), '--max-seq')) / 1e6:.2f}M"
    stated = _flat(PLAN_DOC) + _flat(README)
    for phrase in phrases:
        assert phrase.format(m=millions) in stated, phrase.format(m=millions)


def test_the_70b_terms_stated_are_the_plan_s(capsys: pytest.CaptureFixture) -> None:
    out = _plan(capsys, "llama3_70b.json", "--gpus", "64", "--max-seq")
    row = out.strip().splitlines()[-1].split()
    params, grads, optim, fsdp, saved, transient = row[-11:-5]
    terms = (
        f"parameters {params} GiB, gradients {grads}, AdamW {optim}, FSDP's gathered root and units {fsdp}, "
        f"saved {saved}, one checkpointed layer's recomputation {transient}"
    )
    assert terms in _flat(README), terms


def test_the_best_peak_of_llama_3_8b_at_1m_on_8_gpus_is_the_plan_s(capsys: pytest.CaptureFixture) -> None:
    out = _plan(capsys, "llama3_8b.json", "--gpus", "8", "--seq-len", "1M")
    rows = [line.split() for line in out.splitlines() if line.startswith("dp")]
    best = min(rows, key=lambda row: float(row[-3]))
    peak, name = best[-3], " ".join(best[: len(best) - 11])
    assert f"the best at {peak} GiB per GPU" in _flat(README), peak
    assert f"plans to {peak} GiB per GPU at best (`{name}`" in _flat(PLAN_DOC), (peak, name)
