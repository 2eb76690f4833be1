"""The ``lightning-cp`` command: help, complete configs, one-line errors, and real runs of the example configs.

Parsing cases call :func:`lightning_cp.cli.main` in this process (no trainer runs here). Training runs call
it on every rank of the shared gloo pools (:func:`_fit_on`), as on the ranks Lightning's launcher starts,
with each rank's output captured; the launch by the installed console script has its own tests (here,
``tests/cli/test_rank_failures.py``, ``tests/test_preemption.py``, the fine-tuning journey). The losses a run
prints and logs are checked against a plain-PyTorch evaluation (``F.cross_entropy`` on full logits) of the
checkpoint it wrote.
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import inspect
import itertools
import json
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch import Trainer

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy, MemoryProfilerCallback
from lightning_cp.callbacks.memory.schedule import parse_steps
from lightning_cp.cli import main
from lightning_cp.data import LongRangeDataModule, TokenFileDataset, write_token_file
from lightning_cp.models import GPTConfig, GPTModule
from tests._dist import WorkerPool, captured
from tests.data._megatron import write_megatron_dataset

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "configs"
MAIN_JOB = CONFIGS / "cpu_long_range.yaml"
PACKED = CONFIGS / "packed_sft_token_file.yaml"
GPU = CONFIGS / "gpu_long_context.yaml"
GPU_SINGLE = CONFIGS / "gpu_single.yaml"
HF_CPU = CONFIGS / "hf_qwen3_tiny_cpu.yaml"
HF_GPU = CONFIGS / "hf_llama_gpu.yaml"
HF_ONE_GPU = CONFIGS / "hf_llama_1gpu.yaml"
FSDP_VARIANTS = {CONFIGS / "cpu_long_range_fsdp.yaml": MAIN_JOB, CONFIGS / "gpu_long_context_fsdp.yaml": GPU}
CONSOLE_SCRIPT = Path(sys.executable).with_name("lightning-cp")
ERROR_PREFIX = "lightning-cp: error: "


def _run_console_script(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    # One intra-op thread per process: 2 or 4 training processes share the small CI machine's cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# --- help -------------------------------------------------------------------------------------------------


def _described_options(help_text: str) -> dict[str, str]:
    """``{"--model.lr": "peak AdamW learning rate.", ...}`` from jsonargparse's help (whitespace collapsed)."""
    text = " ".join(help_text.split("\n\n", 1)[1].split())  # without the usage block
    pattern = r"(--[\w.]+) (?:\S+ )?(.*?)\((?:required, )?type: "
    return {option: description.strip() for option, description in re.findall(pattern, text)}


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the string literal written under it in the class body (read with ``ast``)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, following in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def test_help_documents_model_config_fields_and_data_arguments(cli):
    status, out, _ = cli("fit", "--model.help", "lightning_cp.models.GPTModule")
    assert status == 0
    options = _described_options(out)
    docs = _attribute_docstrings(GPTConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(GPTConfig)}
    for field, doc in docs.items():
        assert options[f"--model.config.{field}"] == doc
    for name in inspect.signature(GPTModule).parameters:
        if name != "config":
            assert options[f"--model.{name}"], f"--model.{name} has no description"

    status, out, _ = cli("fit", "--data.help", "lightning_cp.data.LongRangeDataModule")
    assert status == 0
    options = _described_options(out)
    for name in inspect.signature(LongRangeDataModule).parameters:
        assert options[f"--data.{name}"], f"--data.{name} has no description"
    assert "on each data-parallel rank" in options["--data.batch_size"]

    status, out, _ = cli("fit", "--help")
    assert status == 0
    options = _described_options(out)
    assert "Stop training after this number of steps" in options["--trainer.max_steps"]


@pytest.mark.parametrize("strategy", [MegatronCPStrategy, MegatronCPFSDPStrategy], ids=lambda c: c.__name__)
def test_strategy_help_describes_every_argument(strategy, cli):
    """A docstring entry jsonargparse cannot parse (one naming several arguments) drops them all."""
    status, out, _ = cli("fit", "--trainer.strategy.help", f"lightning_cp.{strategy.__name__}")
    assert status == 0
    # Without the "--X.help [CLASS_PATH_OR_NAME] Show the help for ..." entries of class-typed arguments.
    options = _described_options(
        re.sub(r"  --[\w.]+\.help \[CLASS_PATH_OR_NAME\]\n.*?exit\.", "", out, flags=re.DOTALL)
    )
    # The subclass's own arguments and the shared ones it passes on to MegatronCPBase by *args/**kwargs.
    own = [klass for klass in strategy.__mro__ if klass.__module__.startswith("lightning_cp.")]
    names = {
        parameter.name
        for klass in own
        for parameter in inspect.signature(klass.__init__).parameters.values()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        and parameter.name != "self"
    }
    assert {"cp", "cp_attention", "kv_heads_per_gather"} <= names
    for name in sorted(names):
        assert options.get(f"--trainer.strategy.{name}"), f"--trainer.strategy.{name} has no description"
    assert options["--trainer.strategy.cp"].startswith("context-parallel size")


def test_top_level_help_lists_lightnings_subcommands_and_the_packages_commands(cli):
    status, out, _ = cli("--help")
    assert status == 0
    assert out.splitlines()[0] == "usage: lightning-cp {fit,validate,test,predict,doctor,export-hf,plan} ..."
    commands = dict(re.findall(r"^  ([\w-]+) +(.+)$", out, re.MULTILINE))
    assert set(commands) == {"fit", "validate", "test", "predict", "doctor", "export-hf", "plan"}
    assert commands["fit"] == "Runs the full optimization routine."
    assert commands["doctor"].startswith("Check that lightning-cp computes exactly on this machine")
    assert commands["export-hf"].startswith("Write a trained checkpoint as a transformers directory")
    assert commands["plan"].startswith("Print the per-rank memory of the layouts")


def test_a_package_command_gets_the_rest_of_the_command_line(cli):
    status, out, _ = cli("doctor", "--help")
    assert status == 0
    assert out.startswith("usage: lightning-cp doctor [-h] [--device {auto,cpu,cuda}]")


# --- complete, reusable configs -----------------------------------------------------------------------------


def _print_config(cli, *args: str) -> str:
    status, out, err = cli("fit", *args, "--print_config")
    assert status == 0, err
    return out


def _assert_contains(printed, source, where="config"):
    """Every value written in ``source`` (a YAML tree) is in ``printed`` at the same place."""
    if isinstance(source, dict):
        for key, value in source.items():
            assert key in printed, f"{where}.{key} missing from the printed config"
            _assert_contains(printed[key], value, f"{where}.{key}")
    elif isinstance(source, list):
        assert len(printed) == len(source), where
        for i, (p, s) in enumerate(zip(printed, source)):
            _assert_contains(p, s, f"{where}[{i}]")
    else:
        assert printed == source, f"{where}: printed {printed!r}, written {source!r}"


@pytest.mark.parametrize("config", [MAIN_JOB, PACKED, GPU, GPU_SINGLE, *FSDP_VARIANTS], ids=lambda p: p.stem)
def test_print_config_is_complete_and_reads_back_identically(config, cli, tmp_path):
    printed = _print_config(cli, "--config", str(config))
    tree = yaml.safe_load(printed)
    _assert_contains(tree, yaml.safe_load(config.read_text()))
    # Complete: every Trainer argument and every GPTConfig field is written out, defaults included.
    assert set(inspect.signature(Trainer).parameters) <= set(tree["trainer"])
    assert {f.name for f in dataclasses.fields(GPTConfig)} == set(tree["model"]["init_args"]["config"])

    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    assert _print_config(cli, "--config", str(saved)) == printed


@pytest.mark.parametrize("given", ["file", "inline", "flags"])
def test_a_named_model_and_data_get_their_own_defaults_not_the_default_classes(given, cli, tmp_path):
    """HFCausalLM's lr is 3e-4 and RolloutDataModule packs, whatever GPTModule (lr 3e-3) and the long-range
    data (padded) default to; a command that names neither still gets those two."""
    parts = {
        "model": {"class_path": "lightning_cp.models.HFCausalLM", "init_args": {"config": "runs/tiny"}},
        "data": {
            "class_path": "lightning_cp.data.RolloutDataModule",
            "init_args": {"path": "rollouts.jsonl"},
        },
    }
    if given == "flags":
        args = ["--model", "lightning_cp.models.HFCausalLM", "--model.config", "runs/tiny"]
        args += ["--data=lightning_cp.data.RolloutDataModule", "--data.path", "rollouts.jsonl"]
    elif given == "file":
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump(parts))
        args = ["--config", str(config)]
    else:
        args = [f"--config={yaml.safe_dump(parts, default_flow_style=True)}"]
    tree = yaml.safe_load(_print_config(cli, *args))
    assert tree["model"]["init_args"]["lr"] == 3e-4 and tree["data"]["init_args"]["packed"] is True
    # An argument of the model alone names no class: the default class takes it.
    bare = yaml.safe_load(_print_config(cli, "--model.init_args.weight_decay", "0.1"))
    assert bare["model"]["class_path"] == "lightning_cp.models.GPTModule"
    assert bare["model"]["init_args"]["lr"] == 3e-3 and bare["model"]["init_args"]["weight_decay"] == 0.1
    assert bare["data"]["class_path"] == "lightning_cp.data.LongRangeDataModule"


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_other_subcommands_take_the_same_config(subcommand, cli):
    status, out, err = cli(subcommand, "--config", str(MAIN_JOB), "--print_config")
    assert status == 0, err
    tree = yaml.safe_load(out)
    assert tree["trainer"]["strategy"]["init_args"]["cp"] == 2 and "ckpt_path" in tree


def test_gpu_config_is_a_consistent_long_context_setup(cli):
    # Parsed and validated only: no GPU trainer is built on a CPU machine.
    tree = yaml.safe_load(_print_config(cli, "--config", str(GPU)))
    trainer, model, data = tree["trainer"], tree["model"]["init_args"], tree["data"]["init_args"]
    strategy = trainer["strategy"]
    assert strategy["class_path"] == "lightning_cp.MegatronCPStrategy"
    cp, tp = strategy["init_args"]["cp"], strategy["init_args"]["tp"]
    assert (trainer["accelerator"], trainer["precision"], cp) == ("gpu", "bf16-mixed", 4)
    assert (trainer["devices"] * trainer["num_nodes"]) % (cp * tp) == 0
    assert data["seq_len"] >= 32768 and data["seq_len"] % (2 * cp) == 0
    assert data["vocab_size"] >= 131072 and model["config"]["vocab_size"] >= data["vocab_size"]
    GPTConfig(**model["config"])  # validates the head size
    callbacks = {c["class_path"]: c["init_args"] for c in trainer["callbacks"]}
    MemoryProfilerCallback(**callbacks["lightning_cp.MemoryProfilerCallback"])  # validates steps and ranks
    assert [logger["class_path"] for logger in trainer["logger"]] == ["lightning.pytorch.loggers.CSVLogger"]


def test_gpu_single_config_is_the_main_job_on_one_gpu(cli):
    # Parsed and validated only: no GPU trainer is built on a CPU machine.
    tree = yaml.safe_load(_print_config(cli, "--config", str(GPU_SINGLE)))
    main_job = yaml.safe_load(_print_config(cli, "--config", str(MAIN_JOB)))
    trainer, strategy = tree["trainer"], tree["trainer"]["strategy"]
    assert (trainer["accelerator"], trainer["devices"], trainer["num_nodes"]) == ("gpu", 1, 1)
    assert trainer["precision"] == "bf16-mixed"
    assert strategy["class_path"] == "lightning_cp.MegatronCPStrategy"
    MegatronCPStrategy(**strategy["init_args"])  # validates cp and tp
    assert (strategy["init_args"]["cp"], strategy["init_args"]["tp"]) == (1, 1)
    # The main job's model and task, with its global batch (dp=2 x 8 there) on the one data-parallel rank.
    assert tree["model"] == main_job["model"] and tree["seed_everything"] == main_job["seed_everything"]
    data, main_data = tree["data"]["init_args"], main_job["data"]["init_args"]
    assert {**data, "batch_size": None} == {**main_data, "batch_size": None}
    main_dp = main_job["trainer"]["devices"] // main_job["trainer"]["strategy"]["init_args"]["cp"]
    assert data["batch_size"] == main_dp * main_data["batch_size"]
    for key in ("max_steps", "val_check_interval", "log_every_n_steps"):
        assert trainer[key] == main_job["trainer"][key], key
    callbacks = {c["class_path"]: c["init_args"] for c in trainer["callbacks"]}
    options = callbacks["lightning_cp.MemoryProfilerCallback"]
    profiler = MemoryProfilerCallback(**options)  # validates every option
    assert parse_steps(options["steps"]) == ((5, 5), (20, 21)) and profiler.log_peak


@pytest.mark.parametrize("config", [HF_CPU, HF_GPU], ids=lambda p: p.stem)
def test_hf_config_is_complete_and_builds_its_model(config, cli, tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_cp.models import HFCausalLM

    printed = _print_config(cli, "--config", str(config))
    tree = yaml.safe_load(printed)
    _assert_contains(tree, yaml.safe_load(config.read_text()))
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed)
    assert _print_config(cli, "--config", str(saved)) == printed

    trainer, model, data = tree["trainer"], tree["model"], tree["data"]["init_args"]
    strategy = trainer["strategy"]
    MegatronCPStrategy(**strategy["init_args"])  # validates cp and tp
    cp, tp = strategy["init_args"]["cp"], strategy["init_args"]["tp"]
    assert cp > 1 and (trainer["devices"] * trainer["num_nodes"]) % (cp * tp) == 0
    assert model["class_path"] == "lightning_cp.models.HFCausalLM"
    module = HFCausalLM(**model["init_args"])  # validates the config dict
    with torch.device("meta"):
        module.configure_model()  # transformers accepts the config and attn_implementation="lightning_cp"
    hf_config = module.model.config
    assert isinstance(module.model, transformers.PreTrainedModel)
    assert hf_config._attn_implementation == "lightning_cp"
    assert hf_config.num_key_value_heads < hf_config.num_attention_heads  # grouped-query attention
    assert data["vocab_size"] <= hf_config.vocab_size and data["seq_len"] <= hf_config.max_position_embeddings


def test_hf_gpu_config_is_a_packed_long_context_setup(cli):
    pytest.importorskip("transformers")
    tree = yaml.safe_load(_print_config(cli, "--config", str(HF_GPU)))
    trainer, model, data = tree["trainer"], tree["model"]["init_args"], tree["data"]["init_args"]
    assert (trainer["accelerator"], trainer["devices"], trainer["precision"]) == ("gpu", 8, "bf16-mixed")
    assert trainer["strategy"]["init_args"]["cp"] in (4, 8)
    assert model["gradient_checkpointing"] and data["packed"] and data["seq_len"] >= 32768


def test_the_one_gpu_config_is_the_layout_the_plan_picks_for_its_model_and_length(cli):
    """``hf_llama_1gpu.yaml``: Llama-3.1-8B's shape (``examples/configs/models/llama3_8b.json``) with the
    strategy's and the model's arguments of the first layout ``lightning-cp plan`` fits on one 80 GB GPU at
    the config's sequence length."""
    pytest.importorskip("transformers")
    from lightning_cp.models import HFCausalLM
    from lightning_cp.plan import ModelShape, plan

    tree = yaml.safe_load(_print_config(cli, "--config", str(HF_ONE_GPU)))
    trainer, model, data = tree["trainer"], tree["model"]["init_args"], tree["data"]["init_args"]
    assert (trainer["accelerator"], trainer["devices"], trainer["precision"]) == ("gpu", 1, "bf16-mixed")
    llama = json.loads((CONFIGS / "models" / "llama3_8b.json").read_text())
    assert {**model["config"], "max_position_embeddings": None} == {**llama, "max_position_embeddings": None}
    assert data["seq_len"] <= model["config"]["max_position_embeddings"] and data["batch_size"] == 1
    shape = ModelShape.from_hf_config(model["config"])
    first = next(c for c in plan(shape, data["seq_len"], 1) if c.fits(80 * 10**9))
    arguments = first.arguments(shape)
    strategy = trainer["strategy"]
    assert strategy["class_path"] == "lightning_cp.MegatronCPFSDPStrategy"
    assert strategy["init_args"] == {**strategy["init_args"], **arguments["strategy"]}
    assert {key: model[key] for key in arguments["model"]} == arguments["model"]
    MegatronCPFSDPStrategy(**strategy["init_args"])  # validates every argument
    HFCausalLM(**model)  # validates the config dict


def test_hf_cpu_config_is_dp2_cp2_on_four_processes(cli):
    pytest.importorskip("transformers")
    tree = yaml.safe_load(_print_config(cli, "--config", str(HF_CPU)))
    trainer = tree["trainer"]
    assert (trainer["accelerator"], trainer["devices"], trainer["strategy"]["init_args"]["cp"]) == (
        "cpu",
        4,
        2,
    )
    assert tree["model"]["init_args"]["config"]["model_type"] == "qwen3"


# --- one-line errors --------------------------------------------------------------------------------------


def _strategy_error() -> str:
    with pytest.raises(ValueError) as error:
        Trainer(accelerator="cpu", devices=3, strategy=MegatronCPStrategy(cp=2), logger=False)
    return str(error.value)


def _check_one_line(status: int, out: str, err: str) -> str:
    assert status == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith(ERROR_PREFIX)
    return lines[0][len(ERROR_PREFIX) :]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--trainer.max_stepz", "3"], ["unrecognized arguments: --trainer.max_stepz 3"]),
        (["--trainer.max_steps", "abc"], ["trainer.max_steps: ", "int", "abc"]),
        (["--model.init_args.lr", "abc"], ["model.init_args.lr: ", "float", "abc"]),
        (["--data.init_args.num_val_samples", "[1]"], ["data.init_args.num_val_samples: ", "int", "[1]"]),
        (["--model", "lightning_cp.models.NoSuchModule"], ["model: ", "NoSuchModule"]),
        # Raised by the classes when the CLI builds them, not by the parser:
        (["--model.init_args.config.n_head", "3"], ["n_embd=128 must be divisible by n_head=3"]),
        (
            ["--config", str(MAIN_JOB), "--trainer.strategy.init_args.cp", "0"],
            ["MegatronCPStrategy(cp=0)", ">= 1"],
        ),
        (["--config", str(MAIN_JOB), "--trainer.devices", "3"], ["world size 3", "cp(2) * tp(1) = 2"]),
        (["--data.init_args.seq_len", "127"], ["seq_len=127 must be an even number"]),
        (
            ["--config", str(MAIN_JOB), "--data.init_args.vocab_size", "1000"],
            ["data.vocab_size=1000 is larger than the model's vocab_size=512", "at least 1000"],
        ),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "wrong-type-in-class",
        "list-for-int",
        "unknown-class",
        "bad-model-size",
        "bad-cp",
        "cp-does-not-divide-devices",
        "odd-seq-len",
        "data-vocabulary-larger-than-the-model's",
    ],
)
def test_configuration_errors_are_one_line(args, expected, cli):
    message = _check_one_line(*cli("fit", *args))
    for part in expected:
        assert part in message


def test_unknown_key_in_a_yaml_file_is_one_line(cli, tmp_path):
    config = tmp_path / "typo.yaml"
    config.write_text(MAIN_JOB.read_text().replace("max_steps:", "max_stepz:"))
    message = _check_one_line(*cli("fit", "--config", str(config)))
    assert "trainer.max_stepz" in message


def test_a_steps_window_written_as_a_bare_string_asks_for_a_list(cli, tmp_path):
    config = tmp_path / "steps.yaml"
    config.write_text(MAIN_JOB.read_text().replace("steps: [20]", 'steps: "5-2"'))
    message = _check_one_line(*cli("fit", "--config", str(config)))
    assert message.endswith('steps: expected a list, got the str "5-2": write a list, e.g. ["5-2"].')


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("qwen", "model_type 'qwen' is not a model type of transformers"),
        (None, "the dict has no 'model_type'"),
    ],
    ids=["unknown-model-type", "no-model-type"],
)
def test_hf_config_mistakes_are_one_line(model_type, expected, cli, tmp_path):
    pytest.importorskip("transformers")
    tree = yaml.safe_load(HF_CPU.read_text())
    tree["model"]["init_args"]["config"]["model_type"] = model_type
    if model_type is None:
        del tree["model"]["init_args"]["config"]["model_type"]
    config = tmp_path / "hf.yaml"
    config.write_text(yaml.safe_dump(tree))
    assert expected in _check_one_line(*cli("fit", "--config", str(config)))


def _token_file_mistake(case: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Arguments over the packed token-file config that the data module rejects, and parts of its message."""
    path = tmp_path / "tokens.bin"
    tokens = np.random.default_rng(0).integers(0, 1023, size=4000)
    if case == "missing-file":
        return ["--data.init_args.path", str(path)], [f"path='{path}' does not exist"]
    if case == "empty-file":
        path.write_bytes(b"")
        return ["--data.init_args.path", str(path), "--data.init_args.dtype", "uint16"], [
            "is empty (0 bytes)"
        ]
    if case == "no-dtype":
        tokens.astype(np.uint16).tofile(path)
        return ["--data.init_args.path", str(path)], [
            "has no sidecar",
            "pass dtype='uint16' or dtype='uint32'",
        ]
    if case == "uint32-read-as-uint16":
        tokens.astype(np.uint32).tofile(path)
        return ["--data.init_args.path", str(path), "--data.init_args.dtype", "uint16"], [
            "looks like a uint32 file",
            "Pass dtype='uint32'",
        ]
    if case == "dtype-contradicts-sidecar":
        write_token_file(path, tokens, vocab_size=1024)
        return ["--data.init_args.path", str(path), "--data.init_args.dtype", "uint32"], [
            "dtype='uint32' contradicts the sidecar"
        ]
    assert case == "megatron-with-eos-id"
    prefix = write_megatron_dataset(tmp_path / "train_text_document", [tokens[:100], tokens[100:]], np.uint16)
    return ["--data.init_args.path", prefix], ["eos_id=1023", "leave eos_id unset"]


@pytest.mark.parametrize(
    "case",
    [
        "missing-file",
        "empty-file",
        "no-dtype",
        "uint32-read-as-uint16",
        "dtype-contradicts-sidecar",
        "megatron-with-eos-id",
    ],
)
def test_token_file_mistakes_are_one_line(case, cli, tmp_path):
    args, expected = _token_file_mistake(case, tmp_path)
    # One device: were the mistake found only in `setup`, Lightning would otherwise start rank 1 by re-running
    # this process's command, `python -m pytest`, instead of the test failing here.
    one_device = ["--trainer.devices", "1", "--trainer.strategy.init_args.cp", "1"]
    message = _check_one_line(*cli("fit", "--config", str(PACKED), *one_device, *args))
    for part in expected:
        assert part in message


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--config", str(PACKED), "--data.init_args.path", "no/such/tokens.bin"], "does not exist"),
        (
            ["--config", str(MAIN_JOB), "--data.init_args.seq_len", "127"],
            "seq_len=127 must be an even number",
        ),
    ],
    ids=["missing-token-file", "odd-seq-len"],
)
def test_a_data_error_is_one_line_before_any_rank_starts(args, expected, cli_before_launch):
    """Raised while the data module is built, before Lightning starts one process per device."""
    assert expected in _check_one_line(*cli_before_launch("fit", *args))


def test_console_script_error_is_one_line_on_stderr():
    """The installed command prints the strategy's own message, alone, and no import-time noise."""
    result = _run_console_script("fit", "--config", str(MAIN_JOB), "--trainer.devices", "3")
    assert _check_one_line(result.returncode, result.stdout, result.stderr) == _strategy_error()


def test_errors_while_training_keep_their_traceback(cli, tmp_path):
    """Only parsing and building are shortened to one line; the data module fails here in ``setup``."""
    one_document = tmp_path / "one_document.bin"
    write_token_file(one_document, [5, 6, 1023], vocab_size=1024, eos_id=1023)  # found by the scan in setup
    with pytest.raises(ValueError, match=r"1 samples in path='.*one_document.bin' leaves no training sample"):
        main(
            [
                "fit",
                "--config",
                str(PACKED),
                "--data.init_args.path",
                str(one_document),
                "--trainer.devices",
                "1",
                "--trainer.strategy",
                "auto",
                "--trainer.logger",
                "false",
                "--trainer.default_root_dir",
                str(tmp_path),
            ]
        )


@pytest.mark.parametrize("config", list(FSDP_VARIANTS), ids=lambda p: p.stem)
def test_fsdp_configs_are_their_ddp_configs_with_sharding(config, cli):
    # Parsed and validated only; the CPU one also runs below.
    tree = yaml.safe_load(_print_config(cli, "--config", str(config)))
    base = yaml.safe_load(_print_config(cli, "--config", str(FSDP_VARIANTS[config])))
    strategy, base_strategy = tree["trainer"]["strategy"], base["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_cp.MegatronCPFSDPStrategy"
    assert base_strategy["class_path"] == "lightning_cp.MegatronCPStrategy"
    MegatronCPFSDPStrategy(**strategy["init_args"])  # validates cp / tp and the module lists
    # The sharding and what it names differ; every argument the two strategies share is the same.
    assert strategy["init_args"]["cpu_offload"] is False  # FSDP's alone: the model state stays on the device
    for key in ("fsdp_wrap", "activation_checkpointing", "cpu_offload"):
        strategy["init_args"].pop(key, None)
        base_strategy["init_args"].pop(key, None)
    base_strategy["class_path"] = strategy["class_path"]
    for tree_ in (tree, base):
        for logger in tree_["trainer"]["logger"]:
            logger["init_args"]["save_dir"] = None
    assert tree == base


# --- real runs of the example configs ----------------------------------------------------------------------


def _summary(stdout: str) -> dict:
    """The block ``fit`` prints: ``{"logs": [dir, ...], "checkpoint": path, "val/loss": "6.2480", ...}``."""
    block = stdout[stdout.index("lightning-cp: training ") :].splitlines()[1:]
    summary: dict = {"logs": []}
    for fields in map(str.split, block):
        if fields and fields[0] == "resume:":
            key, value = "resume", fields[-1]
        elif fields and fields[0].endswith(":"):
            key, value = fields[0][:-1], fields[1]
        elif fields:
            key, value = "logs", fields[0]  # the next logger's directory, under the first
        else:
            continue
        if key == "logs":
            summary["logs"].append(value)
        else:
            summary[key] = value
    return summary


def _csv_rows(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _last(rows: list[dict[str, str]], key: str) -> float:
    return float([row[key] for row in rows if row.get(key)][-1])


def _sequence_nll(model: GPTModule, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, int]:
    """Sum and count of next-token NLL of one unsharded sequence ``[S]`` on full logits."""
    length = len(input_ids)
    # The package's attention takes even lengths only; a causal model's outputs ignore a token appended at the end.
    padded = F.pad(input_ids, (0, length % 2))
    with torch.no_grad():
        hidden = model.model(padded[None], torch.arange(len(padded))[None])[0, :length]
        logits = hidden @ model.model.lm_head_weight.T
        nll = F.cross_entropy(logits[:-1], input_ids[1:], reduction="none")
    targets = loss_mask[1:].bool()
    return nll[targets].sum().item(), int(targets.sum())


def _fit_on(pool: WorkerPool, *args: str) -> tuple[str, str]:
    """``lightning-cp fit ARGS`` on every rank of ``pool``, as on the ranks Lightning's launcher starts (the
    launch itself has the console script's tests): rank 0's stdout, where the summary is, and every rank's
    stderr. It must succeed."""
    ranks = pool.run(captured, main, ["fit", *args])
    stderr = "".join(rank.err for rank in ranks)
    assert [rank.status for rank in ranks] == [0] * pool.world_size, stderr[-3000:]
    return ranks[0].out, stderr


def test_main_job_config_runs_with_summary_checkpoint_and_metrics(
    tmp_path, world2, world4, cli_before_launch
):
    loggers = [
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(tmp_path), "name": "csv"},
        },
        {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(tmp_path), "name": "tensorboard"},
        },
    ]
    stdout, _ = _fit_on(
        world4,
        "--config",
        str(MAIN_JOB),
        "--trainer.max_steps",
        "4",
        "--trainer.val_check_interval",
        "2",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.logger",
        json.dumps(loggers),
        "--trainer.enable_progress_bar",
        "false",
    )
    summary = _summary(stdout)
    assert summary["logs"] == [
        str(tmp_path / "csv" / "version_0"),
        str(tmp_path / "tensorboard" / "version_0"),
    ]
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.is_file() and checkpoint.parent.parent == tmp_path / "csv" / "version_0"
    rows = _csv_rows(Path(summary["logs"][0]))
    assert [int(row["step"]) for row in rows if row.get("train/loss_step")] == [0, 1, 2, 3]
    assert [int(row["step"]) for row in rows if row.get("val/loss")] == [1, 3]  # after steps 2 and 4

    # The final val/loss is that of the checkpoint's weights on the validation set, by plain PyTorch.
    config = yaml.safe_load(MAIN_JOB.read_text())["data"]["init_args"]
    data = LongRangeDataModule(**config)
    data.setup("validate")
    model = GPTModule.load_from_checkpoint(checkpoint, map_location="cpu")
    totals = [
        _sequence_nll(model, ids, mask)
        for batch in data.val_dataloader()
        for ids, mask in zip(batch["input_ids"], batch["loss_mask"])
    ]
    reference = sum(t[0] for t in totals) / sum(t[1] for t in totals)
    assert _last(rows, "val/loss") == pytest.approx(reference, rel=1e-5)
    assert float(summary["val/loss"]) == pytest.approx(reference, abs=6e-5)
    assert float(summary["train/loss_epoch"]) == pytest.approx(_last(rows, "train/loss_epoch"), abs=6e-5)

    # `validate` of the same config (its `ckpt_path: last`, the run's last.ckpt), as dp=1 x cp=2 instead of
    # dp=2 x cp=2: the trained weights' number, logged as the run's next version.
    same_run = ["--config", str(MAIN_JOB), "--trainer.logger", json.dumps(loggers)]
    quiet = ["--trainer.enable_progress_bar", "false"]
    world2.run(main, ["validate", *same_run, "--trainer.devices", "2", *quiet])
    validated = _csv_rows(tmp_path / "csv" / "version_1")
    assert _last(validated, "val/loss") == pytest.approx(reference, rel=1e-5)

    # `predict` (dp=1 x cp=2) writes every target's log-probability, reassembled from the CP shards.
    world2.run(main, ["predict", *same_run, "--trainer.devices", "2", *quiet])
    batches = torch.load(tmp_path / "csv" / "version_2" / "predictions" / "logprobs.dp0.pt")
    targets = torch.cat([(b["labels"] != -100).flatten() for b in batches])
    logprobs = torch.cat([b["logprobs"].flatten() for b in batches])
    assert int(targets.sum()) == sum(t[1] for t in totals)
    assert -logprobs[targets].sum().item() == pytest.approx(sum(t[0] for t in totals), rel=1e-5)
    assert (logprobs[~targets] == 0).all()

    # The checkpoint against another configuration: refused, every difference listed, before any rank starts.
    message = _check_one_line(
        *cli_before_launch(
            "fit", *same_run, "--model.init_args.config.n_embd", "256", "--data.init_args.vocab_size", "256"
        )
    )
    assert message == (
        f"ckpt_path: '{checkpoint}' does not fit the configuration: model.init_args.config.n_embd: 128 in the "
        "checkpoint, 256 in the configuration; data.init_args.vocab_size: 512 in the checkpoint, 256 in the "
        "configuration. Set the configuration to the checkpoint's values, or --ckpt_path null for new weights."
    )

    # Re-running the finished run: it says so before any rank starts, exits 0 and leaves no new version behind.
    status, out, err = cli_before_launch("fit", *same_run, "--trainer.max_steps", "4")
    assert status == 0, err[-3000:]
    assert out.strip() == (
        f"lightning-cp: {checkpoint} already reached trainer.max_steps=4 (step 4): nothing to train. Raise "
        "--trainer.max_steps or --trainer.max_epochs to continue it (the optimizer state and the data position "
        "carry on; a new data file, such as the next RL round's rollouts, trains as the next epochs), or "
        "--ckpt_path null to start over."
    )
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == ["version_0", "version_1", "version_2"]

    # Continuing it on dp=1 x cp=2: one step more, from the checkpoint, and the halved global batch is named.
    stdout, stderr = _fit_on(
        world2,
        *same_run,
        "--trainer.max_steps",
        "5",
        "--trainer.devices",
        "2",
        "--trainer.val_check_interval",
        "1",
        "--trainer.log_every_n_steps",
        "1",
        *quiet,
    )
    assert _summary(stdout)["weights"] == str(checkpoint)
    warnings = [line for line in stderr.splitlines() if "the global batch changes" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        "the global batch changes from 16 to 8 samples per optimizer step (dp x batch_size x "
        "accumulate_grad_batches). To keep it, set trainer.accumulate_grad_batches=2."
    )
    assert [
        int(row["step"]) for row in _csv_rows(tmp_path / "csv" / "version_3") if row.get("train/loss_step")
    ] == [4]


# --- mistakes found before any rank starts ---------------------------------------------------------------------


def _late_mistake(case: str, tmp_path: Path) -> tuple[list[str], str]:
    """A command line that used to fail only in the ranks (or run silently), and a part of its one line."""
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}
    run = ["--config", str(MAIN_JOB), "--trainer.logger", json.dumps([logger])]
    if case == "missing-checkpoint":
        return ["fit", *run, "--ckpt_path", str(tmp_path / "missing.ckpt")], "missing.ckpt' does not exist"
    if case == "truncated-checkpoint":
        whole = tmp_path / "whole.ckpt"
        torch.save({"state_dict": {"w": torch.zeros(1000)}, "global_step": 1}, whole)
        (tmp_path / "cut.ckpt").write_bytes(whole.read_bytes()[:2000])
        return ["fit", *run, "--ckpt_path", str(tmp_path / "cut.ckpt")], "is not a readable checkpoint"
    if case == "fsdp-checkpoint-with-ddp":
        (tmp_path / "last.ckpt").mkdir()
        torch.save({"global_step": 1}, tmp_path / "last.ckpt" / "meta.pt")
        return [
            "fit",
            *run,
            "--ckpt_path",
            str(tmp_path / "last.ckpt"),
        ], "set trainer.strategy.class_path: lightning_cp.MegatronCPFSDPStrategy"
    if case == "validate-without-a-checkpoint":
        return ["validate", *run], "ckpt_path: last: no checkpoint of this run matches"
    assert case == "hf-heads-do-not-divide"
    return ["fit", "--config", str(HF_CPU), "--model.init_args.config.num_key_value_heads", "3"], (
        "num_attention_heads=4 is not a multiple of num_key_value_heads=3"
    )


@pytest.mark.parametrize(
    "case",
    [
        "missing-checkpoint",
        "truncated-checkpoint",
        "fsdp-checkpoint-with-ddp",
        "validate-without-a-checkpoint",
        "hf-heads-do-not-divide",
    ],
)
def test_late_mistakes_are_one_line_before_any_rank_starts(case, tmp_path, cli_before_launch):
    """The 4-process configs: one line on stderr and exit 2 from the first process (no rank started)."""
    args, expected = _late_mistake(case, tmp_path)
    assert expected in _check_one_line(*cli_before_launch(*args))


def test_example_configs_that_resume_save_their_last_checkpoint():
    for config in CONFIGS.glob("*.yaml"):
        tree = yaml.safe_load(config.read_text())
        assert tree.get("ckpt_path") == "last", config.name
        callbacks = tree["trainer"].get("callbacks") or []
        saves_last = [
            c
            for c in callbacks
            if c["class_path"].endswith("ModelCheckpoint") and c.get("init_args", {}).get("save_last")
        ]
        assert saves_last, f"{config.name}: ckpt_path: last but no ModelCheckpoint with save_last: true"


def test_packed_token_file_config_runs(tmp_path, monkeypatch, capsys, world2):
    tokens = tmp_path / "tokens.bin"
    script = str(REPO / "examples" / "make_token_file.py")  # as `python <script> ...`, in this process
    monkeypatch.setattr(sys, "argv", [script, str(tokens), "--num-docs", "100", "--max-len", "120"])
    runpy.run_path(script, run_name="__main__")
    assert "wrote 100 documents" in capsys.readouterr().out
    stdout, _ = _fit_on(
        world2,
        "--config",
        str(PACKED),
        "--data.init_args.path",
        str(tokens),
        "--trainer.max_steps",
        "3",
        "--trainer.val_check_interval",
        "3",
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
    )
    summary = _summary(stdout)
    assert summary["logs"] == [str(tmp_path / "csv" / "version_0")]
    rows = _csv_rows(tmp_path / "csv" / "version_0")
    assert [int(row["step"]) for row in rows if row.get("train/loss_step")] == [0, 1, 2]

    # Validation documents: the documented tail of the file's EOS-delimited samples; each scored on its own.
    data = yaml.safe_load(PACKED.read_text())["data"]["init_args"]
    samples = TokenFileDataset(
        tokens, seq_len=data["seq_len"], vocab_size=data["vocab_size"], eos_id=data["eos_id"]
    )
    num_val = max(1, round(data["val_fraction"] * len(samples)))
    model = GPTModule.load_from_checkpoint(summary["checkpoint"], map_location="cpu")
    totals = [
        _sequence_nll(model, s["input_ids"], s["loss_mask"])
        for s in (samples[i] for i in range(len(samples) - num_val, len(samples)))
    ]
    reference = sum(t[0] for t in totals) / sum(t[1] for t in totals)
    assert _last(rows, "val/loss") == pytest.approx(reference, rel=1e-5)
    assert float(summary["val/loss"]) == pytest.approx(reference, abs=6e-5)
    assert (
        math.log(data["vocab_size"]) - 1 < reference < math.log(data["vocab_size"]) + 1
    )  # 3 steps: near chance


def test_cpu_fsdp_config_runs_and_writes_a_sharded_checkpoint(tmp_path, world4):
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}}
    stdout, _ = _fit_on(
        world4,
        "--config",
        str(CONFIGS / "cpu_long_range_fsdp.yaml"),
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.logger",
        json.dumps([logger]),
        "--trainer.callbacks",
        json.dumps([{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint"}]),
        "--trainer.enable_progress_bar",
        "false",
    )
    checkpoint = Path(_summary(stdout)["checkpoint"])
    assert checkpoint.is_dir() and len(list(checkpoint.glob("*.distcp"))) == 4  # one shard per rank
