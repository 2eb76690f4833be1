"""``lightning-cp plan``: its table, ``--max-seq``, help, and one-line errors with exit status 2."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightning_cp.adaptation import applied
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


def test_the_command_prints_its_table_without_the_qlora_extra_s_import_warnings() -> None:
    """transformers imports torchao when it is installed; on a CPU build of torch torchao warns that its CUDA
    extensions do not load. Only a fresh interpreter imports it, so this runs the command as users do."""
    pytest.importorskip("torchao")
    model = MODELS / "qwen3_8b.json"
    command = [
        sys.executable,
        "-m",
        "lightning_cp.cli",
        "plan",
        str(model),
        "--seq-len",
        "128K",
        "--gpus",
        "8",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    assert result.stdout.startswith("transformers: ")
    assert result.stderr == ""


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
        (["{model}", "--seq-len", "1M", "--lora", "0"], "--lora 0: give a positive LoRA rank"),
        (["{model}", "--seq-len", "1M", "--qlora", "--lora", "-2"], "--lora -2: give a positive LoRA rank"),
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


def _built(part: dict) -> object:
    """The object a parsed ``class_path`` / ``init_args`` part of a config names."""
    module, name = part["class_path"].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(**part.get("init_args", {}))


@pytest.mark.parametrize(
    ("model", "argv", "precision", "module"),
    [
        (
            "gpt",
            ["--gpus", "2", "--seq-len", "512K", "--gpu-memory", "24GiB", "--precision", "bf16-true"],
            "bf16-true",
            "GPTModule",
        ),
        (str(MODELS / "llama3_8b.json"), ["--gpus", "1", "--max-seq"], "bf16-mixed", "HFCausalLM"),
    ],
    ids=["gpt-tiled-bf16-true", "llama-tiled-cpu-offload"],
)
def test_the_printed_arguments_are_a_fit_config_of_the_planned_layout(
    model: str, argv: list[str], precision: str, module: str, gpt_json: Path, cli, tmp_path: Path
) -> None:
    """The printed YAML with the model's own config beside it is a ``lightning-cp fit`` config: the CLI's
    parser takes every argument for the class it names (the package GPT's ``tiled`` is ``GPTModule``'s), the
    Trainer's precision is the plan's (Lightning's default, 32-true, needs twice the memory), and the strategy
    and the module build from what it parsed."""
    pytest.importorskip("transformers")
    path = gpt_json if model == "gpt" else Path(model)
    status, out, err = cli("plan", str(path), *argv)
    assert status == 0, err
    printed = out.split("The first, as arguments:\n")[1]
    given = yaml.safe_load(printed)
    assert given["trainer"]["precision"] == precision
    assert given["model"] == {"class_path": f"lightning_cp.models.{module}", "init_args": {"tiled": True}}
    layout = tmp_path / "layout.yaml"
    layout.write_text(printed)
    own = tmp_path / "model.yaml"
    own.write_text(yaml.safe_dump({"model": {"init_args": {"config": json.loads(path.read_text())}}}))
    status, out, err = cli("fit", "--config", str(layout), "--config", str(own), "--print_config")
    assert status == 0, err[-2000:]
    parsed = yaml.safe_load(out)
    assert parsed["trainer"]["precision"] == precision
    strategy = parsed["trainer"]["strategy"]
    assert strategy["class_path"] == given["trainer"]["strategy"]["class_path"]
    assert strategy["init_args"] == {**strategy["init_args"], **given["trainer"]["strategy"]["init_args"]}
    assert parsed["model"]["class_path"] == given["model"]["class_path"]
    assert parsed["model"]["init_args"]["tiled"] is True
    assert _built(strategy).cp == given["trainer"]["strategy"]["init_args"]["cp"]
    if model == "gpt":
        init_args = parsed["model"]["init_args"]
        built = _built(
            {**parsed["model"], "init_args": {**init_args, "config": GPTConfig(**init_args["config"])}}
        )
        assert "tiling" in applied(built.model.blocks[0].mlp)
    else:
        assert _built(parsed["model"]).hparams.tiled


def test_an_unknown_model_type_is_one_short_line_with_the_closest_names(tmp_path: Path, capsys) -> None:
    """The message of ``fit`` (``HFCausalLM``'s check), not transformers' list of every model type."""
    pytest.importorskip("transformers")
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"model_type": "lamma", "hidden_size": 64}))
    assert main(["plan", str(typo), "--seq-len", "1M"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 300, err[:500]
    assert "model_type 'lamma' is not a model type of transformers" in err and "Did you mean 'llama'" in err


def test_qlora_plans_a_4_bit_base_and_prints_the_lora_argument(capsys) -> None:
    """``--qlora`` (rank 16 unless ``--lora``; ``torchao`` not needed to count) describes the frozen base in
    NF4 and prints ``HFCausalLM``'s ``lora`` dict with the first layout; ``--lora 8`` the bf16 base. With
    ``--host-memory`` the bound, the first layout keeps some layers' inputs on the GPU."""
    pytest.importorskip("transformers")
    argv = [
        "plan",
        str(MODELS / "llama3_8b.json"),
        "--gpus",
        "1",
        "--gpu-memory",
        "24GB",
        "--seq-len",
        "128K",
    ]
    assert main([*argv, "--qlora", "--host-memory", "64GB"]) == 0
    out = capsys.readouterr().out
    assert "QLoRA rank 16 on 224 linear layers: 41.9M adapter parameters" in out
    given = yaml.safe_load(out.split("The first, as arguments:\n")[1])
    lora = {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear", "quantize": "nf4"}
    assert given["model"]["init_args"]["lora"] == lora
    assert given["model"]["init_args"]["dtype"] == "bfloat16"  # the frozen base as counted
    assert isinstance(given["trainer"]["strategy"]["init_args"]["offload_activations"], int)
    assert main([*argv, "--lora", "8", "--gpu-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 8 on 224 linear layers" in out and "the base frozen, in bf16: 15.0 GiB" in out
    given = yaml.safe_load(out.split("The first, as arguments:\n")[1])
    assert given["model"]["init_args"]["lora"] == {**lora, "rank": 8, "alpha": 16, "quantize": None}


def test_the_per_step_columns_of_llama_3_1_8b_on_8_gpus_at_1m_are_the_hand_counts(capsys) -> None:
    """The first layout for Llama-3.1-8B at 1M tokens on 8 GPUs (``dp1 x cp8 FSDP ulysses +ckpt +offload``):
    its CP bytes (Ulysses' two all-to-alls of q, k, v, out each way and again for the recomputed forward), FSDP's
    (bf16 gathers for the forward and the backward, the fp32 reduce-scatter), the offloaded layer inputs'
    copies and one rank's FLOPs (6 N T + causal attention; checkpointing's forward again), by hand."""
    pytest.importorskip("transformers")
    from lightning_cp.plan.flops import step_flops

    seq, gpus, cp, layers, hidden, vocab = 1 << 20, 8, 8, 32, 4096, 128256
    heads, kv_heads, head_dim, params = 32, 8, 128, 8_030_261_248
    argv = ["plan", str(MODELS / "llama3_8b.json"), "--seq-len", "1M", "--gpus", str(gpus)]
    assert main(argv) == 0
    first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dp"))
    assert first[:62].rstrip() == "dp1 x cp8 FSDP ulysses +ckpt +offload"
    tokens = seq // cp
    # Ulysses: q and out (heads x 128), k and v (8 heads, cp = 8 of them), bf16; 7/8 of it leaves the rank.
    all_to_all = tokens * (2 * heads * head_dim + 2 * max(kv_heads, cp) * head_dim) * 2 * (cp - 1) // cp
    cp_sent = 3 * layers * all_to_all
    fsdp_sent = 2 * (gpus - 1) * params * 2 // gpus + (gpus - 1) * params * 4 // gpus
    copied = 2 * layers * tokens * hidden * 2  # every layer's bf16 input out and back
    n = params - 2 * vocab * hidden + vocab * hidden  # the embedding is a lookup; the head a matmul
    attention = 6 * 2 * head_dim * heads * layers * (seq * (seq + 1) // 2 // cp)
    model, recomputed = 6 * n * tokens + attention, 2 * (n - vocab * hidden) * tokens + attention // 3

    shape = ModelShape.from_hf_config(json.loads((MODELS / "llama3_8b.json").read_text()))
    layout = next(layout for layout in layouts(gpus, shape) if layout.name() == first[:62].rstrip())
    planned = candidate(shape, seq, layout).estimate
    assert planned.cp_communication == cp_sent
    assert planned.communication - planned.cp_communication == fsdp_sent
    assert planned.host_transfer == copied
    flops = step_flops(shape, seq, layout)
    assert (flops.model, flops.recomputed) == (model, recomputed)
    words = first.split()
    assert words[-4:-1] == [f"{nbytes / 2**30:.1f}" for nbytes in (copied, cp_sent, fsdp_sent)]
    assert words[-1] == f"{model / 1e15:.1f}+{recomputed / 1e15:.1f}"


def test_a_figure_as_wide_as_its_column_keeps_a_space_before_it():
    """GLM-5 on one GPU at 1M tokens kept 16,860.7 GiB on the host: as wide as the column, it ran into the peak
    (``804.816860.7``). Every figure is its own word, under its header."""
    import dataclasses

    from lightning_cp.cli.plan import _header, _row
    from lightning_cp.plan.flops import step_flops

    shape = ModelShape.from_hf_config(json.loads((MODELS / "llama3_8b.json").read_text()))
    layout = layouts(1, shape)[0]
    planned = candidate(shape, 1 << 20, layout)
    wide = dataclasses.replace(
        planned, estimate=dataclasses.replace(planned.estimate, host=int(16860.7 * 2**30))
    )
    row, header = _row(wide, False, step_flops(shape, 1 << 20, layout)), _header(False)
    words = row.split()
    assert words[words.index("16860.7") - 1] == f"{planned.estimate.peak / 2**30:.1f}"  # the peak, apart
    assert len(row) == len(header) + 1  # one character wider: the one figure that filled its column
