"""``export_hf``: a fine-tuned checkpoint back to a ``transformers`` directory with the trained logits.

A tiny pretrained model is fine-tuned (DDP or FSDP over DP x CP) and saved; the trained module's logits
come from ``Trainer.predict(ckpt_path=...)`` through the package (CP shards reassembled), the reference
from ``AutoModelForCausalLM.from_pretrained(export)`` with ``"sdpa"`` on the whole sequence, which knows
nothing of the package. The fine-tuning moves the weights far enough that the pretrained model's logits
fail the same comparison.
"""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy, export_hf
from lightning_cp.cli import main as cli_main
from lightning_cp.data import collate_padded
from lightning_cp.hf import ExportHFOnFitEnd
from lightning_cp.models import HFCausalLM
from tests._trainer import quiet_trainer
from tests.hf._models import VOCAB, build
from tests.hf._pretrained import (
    SEQ,
    assert_logits_of,
    fit_and_save,
    save_pretrained,
    sharded_logits,
    stored_tensors,
)

transformers = pytest.importorskip("transformers")


def _trained_rows(pool, directory, checkpoint, cp, fsdp):
    return pool.run(sharded_logits, directory, cp, "32-true", checkpoint, fsdp)[0][0]


def _check_export(directory, checkpoint, rows, output):
    export_hf(checkpoint, output)
    model = assert_logits_of(output, rows)
    with pytest.raises(AssertionError):  # the export holds the trained weights, not the pretrained ones
        assert_logits_of(directory, rows)
    return model


def test_export_from_ddp_checkpoint_gives_trained_logits(world2, tmp_path):
    directory = save_pretrained("llama", tmp_path / "llama")
    (directory / "tokenizer.json").write_text("{}")
    checkpoint = tmp_path / "ddp.ckpt"
    world2.run(fit_and_save, directory, 2, False, checkpoint)
    rows = _trained_rows(world2, directory, checkpoint, cp=2, fsdp=False)
    model = _check_export(directory, checkpoint, rows, tmp_path / "export")
    assert model.dtype == torch.float32 and not model.config.tie_word_embeddings
    assert (tmp_path / "export" / "tokenizer.json").read_text() == "{}"
    assert (tmp_path / "export" / "generation_config.json").is_file()


@pytest.mark.parametrize("name", ["llama", "qwen3"], ids=["untied", "tied"])
def test_export_from_fsdp_folder_gives_trained_logits(name, world2, tmp_path):
    directory = save_pretrained(name, tmp_path / name)
    checkpoint = tmp_path / "fsdp.ckpt"
    world2.run(fit_and_save, directory, 2, True, checkpoint)
    assert checkpoint.is_dir()
    rows = _trained_rows(world2, directory, checkpoint, cp=2, fsdp=True)
    model = _check_export(directory, checkpoint, rows, tmp_path / "export")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight or name == "llama"
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (name == "llama")  # a tied head is stored once


def test_export_of_a_folder_written_at_dp2_cp2_matches_its_reshard_at_cp2(world2, world4, tmp_path):
    """Trained on 4 ranks, the trained module's logits read back on 2 (resharded), the export in 1 process."""
    directory = save_pretrained("qwen3", tmp_path / "qwen3")
    checkpoint = tmp_path / "fsdp.ckpt"
    world4.run(fit_and_save, directory, 2, True, checkpoint)
    rows = _trained_rows(world2, directory, checkpoint, cp=2, fsdp=True)
    _check_export(directory, checkpoint, rows, tmp_path / "export")


def test_export_in_bf16_with_small_shards_and_the_cli(world2, tmp_path, capsys):
    directory = save_pretrained("llama", tmp_path / "llama")
    checkpoint = tmp_path / "fsdp.ckpt"
    world2.run(fit_and_save, directory, 2, True, checkpoint, 1)
    rows = _trained_rows(world2, directory, checkpoint, cp=2, fsdp=True)
    output = tmp_path / "export"
    status = cli_main(
        ["export-hf", str(checkpoint), str(output), "--dtype", "bfloat16", "--max-shard-mb", "0.01"]
    )
    assert status == 0 and str(output) in capsys.readouterr().out
    index = json.loads((output / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert {tensor.dtype for tensor in stored_tensors(output).values()} == {torch.bfloat16}
    model = assert_logits_of(output, rows, torch.bfloat16)
    assert model.dtype == torch.bfloat16


def test_export_refuses_a_checkpoint_without_a_transformers_config(tmp_path):
    torch.save({"state_dict": {}, "hyper_parameters": {"lr": 1.0}}, tmp_path / "gpt.ckpt")
    with pytest.raises(ValueError, match="hyper_parameters have no 'config'"):
        export_hf(tmp_path / "gpt.ckpt", tmp_path / "out")
    with pytest.raises(ValueError, match="no such checkpoint"):
        export_hf(tmp_path / "missing.ckpt", tmp_path / "out")


def test_cli_reports_a_bad_checkpoint_as_one_line(tmp_path, capsys):
    assert cli_main(["export-hf", str(tmp_path / "missing.ckpt"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning-cp export-hf: error: ") and "missing.ckpt" in err[0]


def _fit_with_export(directory, output, fsdp):
    """Fine-tune under FSDP with the model state on the host (``cpu_offload``: the pretrained shards read
    into host memory) or under DDP, exporting at the end of fit over any earlier export; return the trained
    weights (``full_state_dict`` after fit: rank 0's, ``{}`` on the other)."""
    torch.manual_seed(2)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(8)]
    strategy = MegatronCPFSDPStrategy(cp=2, cpu_offload=True) if fsdp else MegatronCPStrategy(cp=2)
    trainer = quiet_trainer(
        devices=2, strategy=strategy, max_steps=2, callbacks=[ExportHFOnFitEnd(str(output), overwrite=True)]
    )
    loader = DataLoader(data, batch_size=2, collate_fn=collate_padded)
    trainer.fit(HFCausalLM(str(directory), lr=3e-2), loader)
    return trainer.strategy.full_state_dict()


def test_the_end_of_fit_export_of_an_fsdp_then_a_ddp_run_leaves_the_trained_weights_only(world2, tmp_path):
    """The same export written by an FSDP run, then by a DDP run: each holds its run's trained weights (as
    ``full_state_dict`` gathers them after fit, on rank 0 alone, in host memory), and nothing else is left
    beside it: no checkpoint, no optimizer state (before the change ``export.ckpt`` stayed, with the
    optimizer state, and the DDP run failed writing its file where the FSDP run had left that folder)."""
    directory = save_pretrained("qwen3", tmp_path / "qwen3")
    output = tmp_path / "export"
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32
    ).state_dict()
    for fsdp in (True, False):
        weights, other = world2.run(_fit_with_export, directory, output, fsdp)
        assert other == {}
        assert sorted(path.name for path in tmp_path.iterdir()) == ["export", "qwen3"]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32).state_dict()
        assert {f"model.{name}" for name in loaded} <= weights.keys()
        for name, tensor in loaded.items():
            trained = weights[f"model.{name}"]
            assert trained.device.type == "cpu" and torch.equal(tensor, trained), name
        assert not torch.equal(loaded["model.norm.weight"], pretrained["model.norm.weight"])


def _checkpoint_of(model, config, path):
    """A ``.ckpt`` as ``MegatronCPStrategy`` saves an ``HFCausalLM`` of ``config`` holding ``model``."""
    state = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    torch.save({"state_dict": state, "hyper_parameters": {"config": config}}, path)
    return path


def _files(directory):
    return {file.name: file.read_bytes() for file in directory.iterdir() if file.is_file()}


def _assert_loads(directory, model):
    """``from_pretrained(directory)`` holds exactly ``model``'s weights."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_an_output_that_holds_weights_is_refused_unless_overwrite_replaces_the_whole_set(tmp_path, capsys):
    """Into the pretrained directory itself, then over an earlier export with fewer shards: refused without
    ``--overwrite`` (nothing written), and with it ``from_pretrained`` loads the new weights only."""
    pretrained = save_pretrained("llama", tmp_path / "llama")
    before = _files(pretrained)
    torch.manual_seed(5)
    trained = build("llama", "sdpa")
    checkpoint = _checkpoint_of(trained, str(pretrained), tmp_path / "trained.ckpt")
    capsys.readouterr()

    assert cli_main(["export-hf", str(checkpoint), str(pretrained)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds model.safetensors" in err[0] and "--overwrite" in err[0]
    assert _files(pretrained) == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "llama",
        "trained.ckpt",
    ]  # nothing written, no staging folder left

    assert cli_main(["export-hf", str(checkpoint), str(pretrained), "--overwrite"]) == 0
    _assert_loads(pretrained, trained)
    assert "model.safetensors" not in _files(pretrained)
    assert json.loads((pretrained / "config.json").read_text())["dtype"] == "float32"  # was bfloat16

    torch.manual_seed(6)
    retrained = build("llama", "sdpa")
    again = _checkpoint_of(retrained, str(pretrained), tmp_path / "retrained.ckpt")
    with pytest.raises(ValueError, match="already holds model.safetensors.index.json and 1 more"):
        export_hf(again, pretrained)
    export_hf(again, pretrained, max_shard_bytes=20_000, overwrite=True)
    index = json.loads((pretrained / "model.safetensors.index.json").read_text())
    shards = {name for name in _files(pretrained) if name.endswith(".safetensors")}
    assert shards == set(index["weight_map"].values()) and len(shards) > 1  # the earlier shard is gone
    _assert_loads(pretrained, retrained)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_cli_dtype_is_the_dtype_of_every_stored_tensor(dtype, tmp_path, capsys):
    """An fp32 checkpoint exported with ``--dtype``: every stored tensor (not only the config and the loader's
    cast) in that dtype, holding the fp32 weights rounded to it, and the index's size counted in it."""
    pretrained = save_pretrained("llama", tmp_path / "llama")
    torch.manual_seed(5)
    trained = build("llama", "sdpa")
    checkpoint = _checkpoint_of(trained, str(pretrained), tmp_path / "trained.ckpt")
    assert cli_main(["export-hf", str(checkpoint), str(tmp_path / "export"), "--dtype", dtype]) == 0
    capsys.readouterr()
    stored = stored_tensors(tmp_path / "export")
    cast = getattr(torch, dtype)
    expected = {name: tensor.to(cast) for name, tensor in trained.state_dict().items()}
    assert stored.keys() == expected.keys()
    for name, tensor in stored.items():
        assert tensor.dtype == cast and torch.equal(tensor, expected[name]), name
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == dtype


def test_a_failed_export_leaves_the_output_as_it_was(tmp_path, monkeypatch):
    pretrained = save_pretrained("llama", tmp_path / "llama")
    torch.manual_seed(5)
    checkpoint = _checkpoint_of(build("llama", "sdpa"), str(pretrained), tmp_path / "trained.ckpt")
    export_hf(checkpoint, tmp_path / "export")
    before = _files(tmp_path / "export")
    writes = []

    def full_disk(tensors, filename, metadata=None):
        writes.append(filename)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return save_file(tensors, filename, metadata=metadata)

    from safetensors.torch import save_file

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        export_hf(checkpoint, tmp_path / "export", max_shard_bytes=20_000, overwrite=True)
    assert _files(tmp_path / "export") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "llama", "trained.ckpt"]


def test_the_end_of_fit_export_refuses_a_used_output_before_training(tmp_path):
    pretrained = save_pretrained("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match=r"already holds model\.safetensors .*overwrite=True"):
        ExportHFOnFitEnd(str(pretrained))
    ExportHFOnFitEnd(str(pretrained), overwrite=True)
    ExportHFOnFitEnd(str(tmp_path / "new"))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("gpt", "is not a Hugging Face transformers model (its hyperparameter 'config' is a "),
        ({"vocab_size": 8}, "the dict has no 'model_type'"),
        ({"model_type": "lama"}, "model_type 'lama' is not a model type of transformers"),
        ({"model_type": "vit"}, "model_type 'vit' has no causal-LM class"),
        ("missing-directory", "not a local directory"),
    ],
    ids=[
        "gpt-module",
        "no-model-type",
        "unknown-model-type",
        "not-a-causal-lm",
        "moved-pretrained-directory",
    ],
)
def test_a_checkpoint_of_another_kind_of_model_is_one_line(config, expected, tmp_path, capsys):
    from lightning_cp.models import GPTConfig

    if config == "gpt":
        config = GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16)
    elif config == "missing-directory":
        config = str(tmp_path / "moved")
    checkpoint = tmp_path / "other.ckpt"
    torch.save(
        {"state_dict": {"model.w": torch.zeros(2)}, "hyper_parameters": {"config": config}}, checkpoint
    )
    capsys.readouterr()
    assert cli_main(["export-hf", str(checkpoint), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith("lightning-cp export-hf: error: export_hf(")
        and expected in err[0]
    )
    assert not (tmp_path / "out").exists()


def test_a_fit_that_would_export_into_a_used_output_is_one_line_before_any_rank_starts(
    tmp_path, capfd, monkeypatch
):
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # Lightning's seeding sets them: put back after
        monkeypatch.setenv(name, "0")
    pretrained = save_pretrained("llama", tmp_path / "llama")
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "hf_qwen3_tiny_cpu.yaml"
    callback = [
        "--trainer.callbacks+=lightning_cp.hf.ExportHFOnFitEnd",
        f"--trainer.callbacks.output_dir={pretrained}",
    ]
    capfd.readouterr()
    with pytest.raises(SystemExit) as status:
        cli_main(["fit", "--config", str(config), *callback])
    out, err = capfd.readouterr()
    assert status.value.code == 2 and out == ""
    [line] = err.strip().splitlines()
    assert line.startswith("lightning-cp: error: export_hf: output_dir") and "overwrite=True" in line


def test_a_composite_export_casts_only_the_text_model_and_writes_its_own_untied_head(tmp_path):
    """A Gemma-3 composite with an untied head, which ``save_pretrained`` stores as
    ``language_model.lm_head.weight`` beside ``language_model.model.*``: exported in bf16 from an fp32
    checkpoint, the text tensors (the head included) are the trained ones in bf16, every vision tensor keeps
    its stored fp32 bytes, and ``transformers``' composite class gives the trained text model's logits."""
    from lightning_cp.hf.loading import load_pretrained
    from tests.hf.test_composite import COMPOSITES

    directory = tmp_path / "gemma3"
    spec = {**COMPOSITES["gemma3"], "tie_word_embeddings": False}
    spec["text_config"] = {**spec["text_config"], "tie_word_embeddings": False}
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("gemma3", **spec)
    transformers.AutoModelForImageTextToText.from_config(config).save_pretrained(directory)
    stored = stored_tensors(directory)
    assert "language_model.lm_head.weight" in stored and "lm_head.weight" not in stored
    text = load_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        for parameter in text.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)  # "trained"
    checkpoint = _checkpoint_of(text, str(directory), tmp_path / "trained.ckpt")

    export_hf(checkpoint, tmp_path / "export", dtype=torch.bfloat16)
    written = stored_tensors(tmp_path / "export")
    assert written.keys() == stored.keys()
    towers = [name for name in stored if not name.startswith("language_model.")]
    assert len(towers) > 10 and all(stored[name].dtype == torch.float32 for name in towers)
    for name in towers:
        assert written[name].dtype == torch.float32 and torch.equal(written[name], stored[name]), name
    assert torch.equal(written["language_model.lm_head.weight"], text.lm_head.weight.to(torch.bfloat16))

    composite = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "export", dtype=torch.float32
    )
    with torch.no_grad():  # the weights as exported (buffers such as the rotary frequencies stay fp32)
        for parameter in text.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))
    ids = torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(
            composite(input_ids=ids).logits, text(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_a_bf16_folder_exports_in_bf16(tmp_path):
    """An FSDP folder of bf16 parameters (``bf16-true``), as ``MegatronCPFSDPStrategy`` writes it: the export
    keeps bf16 (files and config) and holds its exact values."""
    from lightning_cp.checkpoint_format import save_sharded

    pretrained = save_pretrained("llama", tmp_path / "llama")  # stored in bf16
    torch.manual_seed(5)
    trained = build("llama", "sdpa").to(torch.bfloat16)
    state = {f"model.{name}": tensor for name, tensor in trained.state_dict().items()}
    save_sharded(
        {"state_dict": state, "hyper_parameters": {"config": str(pretrained)}}, tmp_path / "fsdp.ckpt", 0
    )

    export_hf(tmp_path / "fsdp.ckpt", tmp_path / "export")
    assert {tensor.dtype for tensor in stored_tensors(tmp_path / "export").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert loaded.dtype == torch.bfloat16
    for name, tensor in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
