"""``lightning-cp plan``: its table, ``--max-seq``, help, and one-line errors with exit status 2."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import yaml

from lightning_cp.cli import main
from lightning_cp.models.gpt import GPTConfig
from lightning_cp.plan import ModelShape, layouts, max_seq_len
from lightning_cp.plan.search import candidate

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "examples" / "configs" / "models"


@pytest.fixture
def gpt_json(tmp_path: Path) -> Path:
    path = tmp_path / "gpt.json"
    path.write_text(json.dumps({"vocab_size": 32768, "n_layer": 8, "n_head": 8, "n_embd": 1024}))
    return path


def test_plan_lists_the_fitting_layouts_with_their_terms(gpt_json: Path, capsys) -> None:
    assert main(["plan", str(gpt_json), "--seq-len", "64K", "--gpus", "4", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    shape = ModelShape.from_gpt_config(GPTConfig(vocab_size=32768, n_layer=8, n_head=8, n_embd=1024))
    assert "65,536 tokens per sequence on 4 GPUs of 24.0 GiB" in out
    rows = [line for line in out.splitlines() if line.startswith("dp")]
    assert rows and not any("does not fit" in row for row in rows)
    # Each row's peak is the plan's, and the fitting ones are exactly those within the memory.
    planned = [candidate(shape, 1 << 16, layout) for layout in layouts(4, shape)]
    fitting = [found for found in planned if found.estimate.peak <= 24 * 2**30]
    assert len(rows) == len(fitting)
    first = min(fitting, key=lambda found: found.cost())
    assert rows[0][:62].rstrip() == first.layout.name()
    assert f"{first.estimate.peak / 2**30:.1f}" in rows[0].split()


def test_plan_says_when_nothing_fits(gpt_json: Path, capsys) -> None:
    assert (
        main(["plan", str(gpt_json), "--seq-len", "1M", "--gpus", "1", "--gpu-memory", "4GB", "--all"]) == 0
    )
    out = capsys.readouterr().out
    assert "no layout fits" in out and "does not fit" in out


def test_max_seq_prints_the_longest_sequence(gpt_json: Path, capsys) -> None:
    assert main(["plan", str(gpt_json), "--gpus", "2", "--gpu-memory", "16GiB", "--max-seq"]) == 0
    out = capsys.readouterr().out
    shape = ModelShape.from_gpt_config(GPTConfig(vocab_size=32768, n_layer=8, n_head=8, n_embd=1024))
    longest = max(max_seq_len(shape, layout, 16 * 2**30) for layout in layouts(2, shape))
    assert f": {longest:,} tokens" in out


def test_plan_reads_the_shipped_hf_configs(capsys) -> None:
    pytest.importorskip("transformers")
    assert main(["plan", str(MODELS / "qwen3_8b.json"), "--seq-len", "128K", "--gpus", "8"]) == 0
    assert "36 layers, hidden 4096, 32/8 heads x 128, ffn 12288, vocab 151936" in capsys.readouterr().out


def test_plan_is_a_listed_command(capsys) -> None:
    assert main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--help"])
    assert exit_.value.code == 0
    assert "--max-seq" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.json", "--seq-len", "1M"], "no such file or directory"),
        (["{model}", "--seq-len", "1.5M"], "--seq-len '1.5M'"),
        (["{model}", "--seq-len", "0"], "--seq-len '0'"),
        (["{model}", "--seq-len", "1M", "--gpu-memory", "lots"], "--gpu-memory 'lots'"),
        (["{model}", "--seq-len", "1M", "--gpus", "0"], "--gpus 0"),
        (["{model}", "--seq-len", "1M", "--host-memory", "0GB"], "--host-memory '0GB'"),
        (["{model}"], "give --seq-len"),
        (["{bad}", "--seq-len", "1M"], "neither a transformers config"),
        (["{listed}", "--seq-len", "1M"], "not a JSON object"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, gpt_json: Path, capsys) -> None:
    bad = gpt_json.with_name("bad.json")
    bad.write_text(json.dumps({"layers": 3}))
    listed = gpt_json.with_name("listed.json")
    listed.write_text("[1, 2]")
    argv = [arg.format(model=gpt_json, bad=bad, listed=listed) for arg in args]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-cp plan: error: ") and message in err and err.count("\n") == 1


def test_one_gpu_fits_llama_3_8b_only_with_the_model_state_on_a_host_large_enough(capsys) -> None:
    """16 bytes per parameter (128 GB) fit no 80 GB GPU: only the ``+cpu_offload`` layouts fit, the first is
    printed as the arguments that give it, and a host smaller than that state rules them all out."""
    pytest.importorskip("transformers")
    argv = ["plan", str(MODELS / "llama3_8b.json"), "--seq-len", "64K", "--gpus", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("dp")]
    assert rows and all("+cpu_offload" in row for row in rows)
    arguments = yaml.safe_load(out.split("The first, as arguments:\n")[1])
    shape = ModelShape.from_hf_config(json.loads((MODELS / "llama3_8b.json").read_text()))
    layout = next(layout for layout in layouts(1, shape) if rows[0][:62].rstrip() == layout.name())
    expected = candidate(shape, 1 << 16, layout).arguments(shape)
    strategy = arguments["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_cp.MegatronCPFSDPStrategy"
    assert strategy["init_args"] == expected["strategy"] and strategy["init_args"]["cpu_offload"] is True
    assert arguments.get("model", {}).get("init_args", {}) == expected["model"]

    assert main([*argv, "--host-memory", "100GB"]) == 0
    assert "no layout fits" in capsys.readouterr().out
    assert main([*argv, "--host-memory", "200GB"]) == 0
    assert "The first, as arguments:" in capsys.readouterr().out


def test_the_printed_arguments_build_the_strategy(gpt_json: Path, capsys) -> None:
    assert main(["plan", str(gpt_json), "--seq-len", "64K", "--gpus", "4", "--gpu-memory", "24GiB"]) == 0
    arguments = yaml.safe_load(capsys.readouterr().out.split("The first, as arguments:\n")[1])
    strategy = arguments["trainer"]["strategy"]
    module, name = strategy["class_path"].rsplit(".", 1)
    built = getattr(importlib.import_module(module), name)(**strategy["init_args"])
    assert built.cp == strategy["init_args"]["cp"]
