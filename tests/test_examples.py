"""The example scripts run as a user runs them (``python examples/<script>.py``, CPU) and print what they claim.

The scripts that neither train through a strategy nor import what the test process has not run in it as
``__main__`` with their command line (:func:`_run`), which saves a second start of torch and Lightning per
run; one that trains through a strategy starts a process group, which would outlive it here, and runs on the
shared one-rank gloo pool instead. The configs in ``examples/configs`` are run by ``tests/test_cli.py``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from lightning_cp.cli import main
from lightning_cp.data import TokenFileDataset
from tests._dist import captured

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NUMBER = r"([-+]?\d+\.\d+(?:e[-+]\d+)?)"


def _run(script: str, *args: str) -> str:
    """``python examples/<script> <args>`` in this process: what it printed (an error exit raises
    ``SystemExit``)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(sys, "argv", [str(EXAMPLES / script), *args])
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    return out.getvalue()


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


def test_make_token_file_rejects_impossible_lengths(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        _run("make_token_file.py", str(tmp_path / "x.bin"), "--min-len", "50", "--max-len", "40")
    assert exit_.value.code == 2 and "--min-len 50 --max-len 40" in capsys.readouterr().err
    assert not (tmp_path / "x.bin").exists()


def test_convert_to_cp_loss_mixin_gives_the_same_losses(world1):
    # A rank of its own, as a single-device run's: the strategy finds the pool's process group already up.
    (result,) = world1.run(
        captured, runpy.run_path, str(EXAMPLES / "convert_to_cp_loss_mixin.py"), run_name="__main__"
    )
    assert result.status == 0, result.err[-3000:]
    out = result.out
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


# --- the fine-tuning journey (README "Fine-tuning a chat model in three commands") --------------------------

REPO = EXAMPLES.parent
SFT_CPU = EXAMPLES / "configs" / "hf_sft_chat_cpu.yaml"
SFT_GPU = EXAMPLES / "configs" / "hf_sft_chat_gpu.yaml"
JOURNEY = "## Fine-tuning a chat model in three commands"
CONSOLE_SCRIPT = str(Path(sys.executable).with_name("lightning-cp"))


def _run_in(cwd: Path, *command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``command`` run in ``cwd`` as a user types it; it must succeed."""
    result = subprocess.run(
        list(command), cwd=cwd, env=env, check=False, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _readme_blocks(language: str, heading: str = JOURNEY) -> list[str]:
    """The ``language`` code blocks of the README's section ``heading`` (the journey's by default)."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(heading) :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


@pytest.fixture(scope="module")
def journey_dir(tmp_path_factory):
    """A working directory where the README's first command ran (``runs/tiny``), as a user runs it."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    directory = tmp_path_factory.mktemp("journey")
    (command,) = [line for line in _readme_blocks("bash")[0].splitlines() if "make_tiny_hf_model" in line]
    script, out_dir = command.split()[1:]
    result = _run_in(directory, sys.executable, str(REPO / script), out_dir)
    assert "400 conversations (chat.jsonl)" in result.stdout
    return directory


def test_make_tiny_hf_model_writes_a_chat_model_transformers_loads_offline(journey_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = journey_dir / "runs" / "tiny"
    tokenizer = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    assert model.config.vocab_size == len(tokenizer) and model.config.model_type == "llama"
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert "{% generation %}" in tokenizer.chat_template
    conversations = [json.loads(line)["messages"] for line in (tiny / "chat.jsonl").read_text().splitlines()]
    assert len(conversations) == 400 and len({json.dumps(c) for c in conversations}) > 350
    for messages in conversations:
        roles = [m["role"] for m in messages if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
    encoded = tokenizer.apply_chat_template(
        conversations[0], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert 0 < sum(encoded["assistant_masks"]) < len(encoded["input_ids"])


def test_the_fine_tuning_journey_runs_in_three_commands(journey_dir, tmp_path):
    """The README's commands in a fresh directory: the config (a few steps), then its Python generates."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    (fit,) = [line for line in _readme_blocks("bash")[0].splitlines() if line.startswith("lightning-cp fit")]
    args = fit.split()[1:]
    args[args.index("--config") + 1] = str(SFT_CPU)
    short = [
        "--trainer.max_steps",
        "4",
        "--trainer.val_check_interval",
        "2",
        "--trainer.enable_progress_bar",
        "false",
    ]
    result = _run_in(journey_dir, CONSOLE_SCRIPT, *args, *short, env=env)
    assert "training finished after 4 steps" in result.stdout
    summary = re.search(
        r"TextDataModule train: 380 documents, \d+ tokens in (\d+) rows of 256, packing efficiency ([\d.]+)%",
        result.stderr,
    )
    assert summary and float(summary.group(2)) > 90, result.stderr[-3000:]
    export = journey_dir / "runs" / "tiny-sft" / "hf"
    assert (export / "config.json").is_file() and (export / "chat_template.jinja").is_file()

    (python,) = _readme_blocks("python")
    generated = _run_in(journey_dir, sys.executable, "-c", python, env=env)
    assert generated.stdout.endswith("\n")  # the decoded reply (after 4 steps it may be empty)

    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(export).state_dict()
    start = AutoModelForCausalLM.from_pretrained(journey_dir / "runs" / "tiny").state_dict()
    assert trained.keys() == start.keys()
    assert any(
        not torch.equal(trained[name], start[name]) for name in start
    )  # the export holds the trained weights


@pytest.mark.parametrize("config", [SFT_CPU, SFT_GPU], ids=lambda p: p.stem)
def test_sft_chat_configs_parse_and_validate(config, journey_dir, cli):
    """Parsed by the CLI (in this process: ``--print_config`` builds nothing), then every argument built as
    the run builds it, with the tiny model's files in place of the data and tokenizer paths (the GPU
    config's 8B directory is not here)."""
    from lightning_cp import MegatronCPFSDPStrategy
    from lightning_cp.data import TextDataModule
    from lightning_cp.hf import ExportHFOnFitEnd

    status, printed, err = cli("fit", "--config", str(config), "--print_config")
    assert status == 0, err[-3000:]
    tree = yaml.safe_load(printed)
    trainer, model, data = tree["trainer"], tree["model"]["init_args"], tree["data"]["init_args"]
    strategy = trainer["strategy"]
    assert strategy["class_path"] == "lightning_cp.MegatronCPFSDPStrategy"
    MegatronCPFSDPStrategy(**strategy["init_args"])
    cp = strategy["init_args"]["cp"]
    assert (trainer["devices"] * trainer["num_nodes"]) % cp == 0 and data["seq_len"] % (2 * cp) == 0
    assert tree["model"]["class_path"] == "lightning_cp.models.HFCausalLM"
    assert model["config"] == data["tokenizer"]  # the pretrained directory's own tokenizer
    callbacks = {c["class_path"]: c["init_args"] for c in trainer["callbacks"]}
    ExportHFOnFitEnd(**callbacks["lightning_cp.hf.ExportHFOnFitEnd"])
    assert tree["data"]["class_path"] == "lightning_cp.data.TextDataModule" and data["format"] == "chat"
    tiny = journey_dir / "runs" / "tiny"
    files = {"path": str(tiny / "chat.jsonl"), "tokenizer": str(tiny)}
    if data["val_path"] is not None:
        files["val_path"] = str(tiny / "chat.jsonl")
    TextDataModule(**{**data, **files})  # validates every other argument
    if config == SFT_CPU:
        assert (trainer["accelerator"], trainer["devices"], cp) == ("cpu", 2, 2)  # dp1 x cp2
        assert (model["config"], data["path"]) == ("runs/tiny", "runs/tiny/chat.jsonl")
        output = callbacks["lightning_cp.hf.ExportHFOnFitEnd"]["output_dir"]
        assert f'from_pretrained("{output}")' in _readme_blocks("python")[0]
    else:
        assert (trainer["accelerator"], trainer["devices"], trainer["precision"]) == ("gpu", 8, "bf16-mixed")
        assert data["seq_len"] == 131072 and model["gradient_checkpointing"]
        assert data["seq_len"] // cp <= 32768  # tokens per GPU


RL = "## Reinforcement learning: GRPO on rollouts"


def _in_directory(directory: Path, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with ``directory`` as the working directory (a pool rank's is the test session's)."""
    here = Path.cwd()
    os.chdir(directory)
    try:
        return fn(*args)
    finally:
        os.chdir(here)


def test_the_rl_recipe_runs_in_its_commands(journey_dir, monkeypatch, world2):
    """The README's RL commands after the model of the fine-tuning journey: rollouts written and rewarded, the
    reference's log-probs predicted, the policy trained (the two ``lightning-cp`` commands on the ranks of the
    shared pool, as on the ranks Lightning's launcher starts); the printed metrics are the policy's."""
    commands = [line.split() for line in _readme_blocks("bash", RL)[0].strip().splitlines()]
    assert [c[:2] for c in commands[1:]] == [
        ["python", "examples/make_rollouts.py"],
        ["lightning-cp", "predict"],
        ["lightning-cp", "fit"],
    ]
    monkeypatch.chdir(journey_dir)
    written = _run("make_rollouts.py", *commands[1][2:])
    assert "wrote 64 rollouts (16 prompts x 4)" in written
    rewards = {json.loads(line)["reward"] for line in (journey_dir / "runs/tiny/rollouts.jsonl").open()}
    assert len(rewards) > 1  # GRPO's advantages are not all 0
    printed = []
    for command in commands[2:]:
        args = command[1:]
        args[args.index("--config") + 1] = str(EXAMPLES / "configs" / "grpo_tiny_cpu.yaml")
        args += ["--trainer.enable_progress_bar", "false"]
        ranks = world2.run(_in_directory, journey_dir, captured, main, args)
        assert [rank.status for rank in ranks] == [0, 0], "".join(rank.err for rank in ranks)[-3000:]
        printed.append(ranks[0].out)
    predicted, trained = printed
    assert "output:     runs/grpo-ref/predictions" in predicted
    assert sorted(p.name for p in (journey_dir / "runs/grpo-ref/predictions").iterdir()) == [
        "logprobs.dp0.jsonl"
    ]
    summary = trained[trained.index("lightning-cp: training finished after 12 steps") :]
    values = dict(re.findall(r"train/rl/(\w+)_epoch:\s+(\S+)", summary))
    assert set(values) == {
        "loss",
        "pg_loss",
        "kl",
        "entropy",
        "clip_fraction",
        "ratio_mean",
        "completion_length",
    }
    assert 0 < float(values["clip_fraction"]) < 1 and float(values["kl"]) > 0

    # The next round's fit with the same ckpt_path (last): the finished run's max_epochs is said, not a run
    # that trains nothing and reports "training finished".
    ranks = world2.run(_in_directory, journey_dir, captured, main, args)
    assert [rank.status for rank in ranks] == [0, 0]
    assert "already trained trainer.max_epochs=2 (epoch 2, step 12): nothing to train" in ranks[0].out
    assert "training finished" not in ranks[0].out
