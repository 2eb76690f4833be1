"""Checkpoints and export of a LoRA run (``HFCausalLM(lora=...)``): resume, the merged model, the adapter directory.

One LoRA fine-tuning at cp 2 under each strategy (DDP: a checkpoint file, FSDP: a sharded folder), and a QLoRA
one under FSDP, save every two steps; a run resumed from the first checkpoint must give the uninterrupted
run's losses. The checkpoints hold the adapters and their AdamW state alone and name the base (its directory
and fingerprint), which the resume rebuilds; one of another base is refused. The FSDP run's last checkpoint is
then exported merged and as a ``peft`` adapter directory (also by ``ExportHFOnFitEnd(adapter=True)`` at the
end of that run); the trained module's own logits (``Trainer.predict`` from that checkpoint, through the
package at cp 2, in fp32) must equal those of ``AutoModelForCausalLM.from_pretrained(merged)`` and of
``PeftModel.from_pretrained(base, adapter)``, which know nothing of the package, to 1e-5; the pretrained
model's logits fail the same comparison. The QLoRA run's merged export must give the logits of
``transformers`` + ``peft`` on the NF4-quantized base with the checkpoint's adapters.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy, export_hf
from lightning_cp.checkpoint_format import FROZEN_BASE, check_partial_state, open_checkpoint
from lightning_cp.cli import main as cli_main
from lightning_cp.data import ResumableDataLoader, collate_padded
from lightning_cp.hf.export import ExportHFOnFitEnd
from lightning_cp.models import HFCausalLM
from tests._trainer import quiet_trainer
from tests.hf._models import CONFIGS, VOCAB
from tests.hf._pretrained import SEQ, assert_logits_of, save_pretrained, sharded_logits

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = {"rank": 4, "alpha": 8.0}
QLORA = LORA | {"quantize": "nf4", "nf4_block_size": 16, "nf4_scaler_block_size": 4}  # whole blocks per shard
STEPS, SAVE_EVERY = 4, 2


class _Losses(Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()


def _fit(directory, fsdp, folder, ckpt_path=None, lora=LORA, export=None):
    """Every rank: STEPS LoRA steps at cp 2 (from ``ckpt_path`` if given), a checkpoint every SAVE_EVERY, and
    with ``export`` the adapter directory written there at the end; the losses by step."""
    torch.manual_seed(2)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(2 * STEPS)]
    losses = _Losses()
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=MegatronCPFSDPStrategy(cp=2) if fsdp else MegatronCPStrategy(cp=2),
        max_steps=STEPS,
        enable_checkpointing=True,
        callbacks=[
            losses,
            ModelCheckpoint(dirpath=folder, every_n_train_steps=SAVE_EVERY, save_top_k=-1),
            *([ExportHFOnFitEnd(export, adapter=True)] if export else []),
        ],
    )
    loader = ResumableDataLoader(data, batch_size=2, collate_fn=collate_padded)  # resumes mid-epoch
    trainer.fit(HFCausalLM(str(directory), lr=3e-2, lora=lora), loader, ckpt_path=ckpt_path)
    return losses.losses


def _interrupted_and_resumed(directory, fsdp, folder, lora, export):
    uninterrupted = _fit(directory, fsdp, f"{folder}/run", lora=lora, export=export)
    resumed = _fit(directory, fsdp, f"{folder}/resumed", f"{folder}/run/epoch=0-step={SAVE_EVERY}.ckpt", lora)
    return uninterrupted, resumed


_ONCE: dict[str, object] = {}  # the fits, once for every test of this module (the pools are per test)


@pytest.fixture
def runs(world2, tmp_path_factory):
    """The pretrained directory and, per run (LoRA under DDP and FSDP, QLoRA under FSDP), the losses of the
    uninterrupted and the resumed run and the folder of their checkpoints; the FSDP LoRA run's
    ``ExportHFOnFitEnd(adapter=True)`` directory is ``fsdp/exported``."""
    if "runs" in _ONCE:
        return _ONCE["runs"]
    root = tmp_path_factory.mktemp("lora_export")
    directory = save_pretrained("llama", root / "llama")
    (directory / "tokenizer.json").write_text("{}")
    found = {}
    for run, fsdp, lora in (("ddp", False, LORA), ("fsdp", True, LORA), ("qlora", True, QLORA)):
        if run == "qlora" and importlib.util.find_spec("torchao") is None:
            continue
        folder = root / run
        export = str(folder / "exported") if run == "fsdp" else None
        found[run] = (
            *world2.run(_interrupted_and_resumed, directory, fsdp, str(folder), lora, export)[0],
            folder,
        )
    _ONCE["runs"] = directory, found
    return _ONCE["runs"]


@pytest.mark.parametrize(
    "run", ["ddp", "fsdp", "qlora"], ids=["ddp-file", "fsdp-folder", "qlora-fsdp-folder"]
)
def test_a_lora_checkpoint_holds_the_adapters_names_the_base_and_resumes_exactly(runs, run):
    directory, found = runs
    if run not in found:
        pytest.skip("QLoRA needs torchao")
    uninterrupted, resumed, folder = found[run]
    assert sorted(resumed) == list(range(SAVE_EVERY + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6, abs=0), f"step {step}"
    checkpoint = open_checkpoint(folder / "run" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    assert len(checkpoint.shapes) == 28  # 2 layers x 7 projections x (A, B), and no base weight
    assert all(".lora_" in n for n in checkpoint.shapes), sorted(checkpoint.shapes)
    base = checkpoint.metadata[FROZEN_BASE]
    assert (base["pretrained"], base["dtype"]) == (str(directory), "float32")
    assert base["lora"]["quantize"] == ("nf4" if run == "qlora" else None)
    assert len(base["tensors"]) == 21 and len(base["checksums"]) == 4  # the stored tensors, named
    if run == "ddp":  # the file's AdamW state: the adapters' only
        [optimizer] = torch.load(checkpoint.path, weights_only=False)["optimizer_states"]
        assert len(optimizer["state"]) == len(checkpoint.shapes)


def _configured(directory, **options):
    module = HFCausalLM(str(directory), **{"lora": LORA, **options})
    module.configure_model()
    return module


def test_a_lora_checkpoint_is_refused_for_another_base_before_anything_loads(runs, tmp_path):
    """What the strategies run before loading (``check_partial_state``): the base rebuilt from the module's
    directory against the checkpoint's record. A copy of the base elsewhere is the same base."""
    directory, found = runs
    checkpoint = found["ddp"][2] / "run" / f"epoch=0-step={SAVE_EVERY}.ckpt"
    copy = shutil.copytree(directory, tmp_path / "moved")
    assert check_partial_state(checkpoint, _configured(copy)) == set(open_checkpoint(checkpoint).shapes)
    other = save_pretrained("llama", tmp_path / "other", seed=1)
    refusals = {
        r"the values of .*weight differ \(another fine-tune": _configured(other),
        r"the base's dtype: float32 there, bfloat16 here": _configured(directory, dtype="bfloat16"),
        r"LoRA\(rank=4 there, 8 here, alpha=8\.0 there, 16\.0 here\)": _configured(
            directory, lora={"rank": 8, "alpha": 16.0}
        ),
        r"this module has lora=None": _configured(directory, lora=None),
    }
    for message, module in refusals.items():
        with pytest.raises(ValueError, match=rf"epoch=0-step=2\.ckpt.*trained on .*llama.*{message}"):
            check_partial_state(checkpoint, module)


@pytest.fixture
def trained(world2, runs):
    """The FSDP run's last checkpoint and the trained module's logits, through the package at cp 2."""
    if "trained" in _ONCE:
        return _ONCE["trained"]
    directory, found = runs
    checkpoint = found["fsdp"][2] / "run" / f"epoch=0-step={STEPS}.ckpt"
    rows = world2.run(sharded_logits, directory, 2, "32-true", checkpoint, True, lora=LORA)[0][0]
    _ONCE["trained"] = directory, checkpoint, rows
    return _ONCE["trained"]


def test_the_merged_export_gives_the_trained_logits(trained, tmp_path, capsys):
    """The base read from the directory the checkpoint names, or from a copy given with ``--base``; another
    base given is refused."""
    directory, checkpoint, rows = trained
    export_hf(checkpoint, tmp_path / "merged")
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert not [n for n in index["weight_map"] if "lora_" in n or "base_layer" in n]
    assert_logits_of(tmp_path / "merged", rows)
    with pytest.raises(AssertionError):  # the adapters moved the model
        assert_logits_of(directory, rows)
    copy = shutil.copytree(directory, tmp_path / "moved")
    assert cli_main(["export-hf", str(checkpoint), str(tmp_path / "from_copy"), "--base", str(copy)]) == 0
    assert_logits_of(tmp_path / "from_copy", rows)
    other = save_pretrained("llama", tmp_path / "other", seed=1)
    assert cli_main(["export-hf", str(checkpoint), str(tmp_path / "wrong"), "--base", str(other)]) == 2
    assert "the values of" in capsys.readouterr().err and not (tmp_path / "wrong").exists()


def test_the_adapter_directory_loads_on_the_base_with_the_trained_logits(trained, tmp_path, capsys):
    """``lightning-cp export-hf --adapter`` of the last checkpoint, and ``ExportHFOnFitEnd(adapter=True)``'s
    directory written at the end of the same run."""
    directory, checkpoint, rows = trained
    output = tmp_path / "adapter"
    assert cli_main(["export-hf", str(checkpoint), str(output), "--adapter"]) == 0
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    for exported in (output, checkpoint.parent.parent / "exported"):
        assert sorted(p.name for p in exported.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "tokenizer.json",
        ]
        config = json.loads((exported / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
            4,
            8.0,
            str(directory),
        )
        base = transformers.AutoModelForCausalLM.from_pretrained(
            directory, attn_implementation="sdpa", dtype=torch.float32
        )
        model = peft.PeftModel.from_pretrained(base, exported)
        for ids, logits in rows:
            with torch.no_grad():
                expected = model(input_ids=ids).logits.float()
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_the_merged_qlora_export_gives_the_quantized_model_with_its_adapters(runs, tmp_path):
    """The QLoRA run's last checkpoint merged: each NF4 weight dequantized plus its update equals
    ``transformers`` + ``peft`` on the base quantized with ``to_nf4`` (as the run's was) and the checkpoint's
    adapters; the unquantized base with the same adapters fails the comparison."""
    directory, found = runs
    if "qlora" not in found:
        pytest.skip("QLoRA needs torchao")
    from torchao.quantization import to_nf4

    checkpoint = found["qlora"][2] / "run" / f"epoch=0-step={STEPS}.ckpt"
    export_hf(checkpoint, tmp_path / "merged")
    source = open_checkpoint(checkpoint)
    adapters = {n.removeprefix("model."): source.read(n) for n in source.shapes}
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(5))
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        got = merged(input_ids=ids).logits

    def reference(quantize):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        for module in model.model.layers.modules() if quantize else ():
            if isinstance(module, torch.nn.Linear):
                weight = to_nf4(
                    module.weight.detach(), QLORA["nf4_block_size"], QLORA["nf4_scaler_block_size"]
                )
                module.weight = torch.nn.Parameter(weight, requires_grad=False)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
        model = peft.inject_adapter_in_model(config, model)
        missing, unexpected = model.load_state_dict(adapters, strict=False)
        assert not unexpected and not [n for n in missing if "lora_" in n]  # every adapter loaded
        with torch.no_grad():
            return model(input_ids=ids).logits

    torch.testing.assert_close(got, reference(quantize=True), rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, reference(quantize=False), rtol=1e-5, atol=1e-5)


def test_adapter_export_of_a_full_fine_tuning_checkpoint_is_refused(tmp_path):
    torch.save({"state_dict": {}, "hyper_parameters": {"config": CONFIGS["llama"]}}, tmp_path / "full.ckpt")
    with pytest.raises(ValueError, match=r"adapter=True\): the checkpoint is of a run without LoRA"):
        export_hf(tmp_path / "full.ckpt", tmp_path / "out", adapter=True)


def test_a_qlora_checkpoint_of_a_random_base_is_refused_before_the_first_step_and_when_saved():
    """A config dict's NF4 base is neither saved nor named (a pretrained directory's is: the runs above)."""
    pytest.importorskip("torchao")
    module = HFCausalLM(CONFIGS["llama"], lora=QLORA)
    with pytest.raises(
        ValueError, match=r"quantize='nf4'\)\) on a config dict: .*from a pretrained directory"
    ):
        module.on_save_checkpoint({})
    # Before the first step when the fit would save one: Trainer's default ModelCheckpoint, ExportHFOnFitEnd.
    for saving in (
        {"checkpoint_callbacks": [object()], "callbacks": []},
        {"checkpoint_callbacks": [], "callbacks": [ExportHFOnFitEnd("out")]},
    ):
        module._trainer = SimpleNamespace(**saving)
        with pytest.raises(ValueError, match=r"enable_checkpointing=False"):
            module.setup("fit")
    module._trainer = SimpleNamespace(checkpoint_callbacks=[], callbacks=[])
    module.setup("fit")
    module._trainer = None


def test_an_adapter_export_at_fit_end_of_a_module_without_lora_is_refused_at_setup():
    module = HFCausalLM(CONFIGS["llama"])
    with pytest.raises(
        ValueError, match=r"ExportHFOnFitEnd\('out', adapter=True\): HFCausalLM trains no LoRA"
    ):
        ExportHFOnFitEnd("out", adapter=True).setup(None, module, "fit")
