"""Checkpoints and export of a LoRA run (``HFCausalLM(lora=...)``): resume, the merged model, the adapter directory.

One LoRA fine-tuning at cp 2 under each strategy (DDP: a checkpoint file, FSDP: a sharded folder) saves every
two steps; a run resumed from the first checkpoint must give the uninterrupted run's losses. The FSDP run's
last checkpoint is then exported merged and as a ``peft`` adapter directory; the trained module's own logits
(``Trainer.predict`` from that checkpoint, through the package at cp 2, in fp32) must equal those of
``AutoModelForCausalLM.from_pretrained(merged)`` and of ``PeftModel.from_pretrained(base, adapter)``, which
know nothing of the package, to 1e-5; the pretrained model's logits fail the same comparison.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy, export_hf
from lightning_cp.checkpoint_format import open_checkpoint
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
STEPS, SAVE_EVERY = 4, 2


class _Losses(Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()


def _fit(directory, fsdp, folder, ckpt_path=None):
    """Every rank: STEPS LoRA steps at cp 2 (from ``ckpt_path`` if given), a checkpoint every SAVE_EVERY; the
    losses by step."""
    torch.manual_seed(2)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(2 * STEPS)]
    losses = _Losses()
    trainer = quiet_trainer(
        devices=dist.get_world_size(),
        strategy=MegatronCPFSDPStrategy(cp=2) if fsdp else MegatronCPStrategy(cp=2),
        max_steps=STEPS,
        enable_checkpointing=True,
        callbacks=[losses, ModelCheckpoint(dirpath=folder, every_n_train_steps=SAVE_EVERY, save_top_k=-1)],
    )
    loader = ResumableDataLoader(data, batch_size=2, collate_fn=collate_padded)  # resumes mid-epoch
    trainer.fit(HFCausalLM(str(directory), lr=3e-2, lora=LORA), loader, ckpt_path=ckpt_path)
    return losses.losses


def _interrupted_and_resumed(directory, fsdp, folder):
    uninterrupted = _fit(directory, fsdp, f"{folder}/run")
    resumed = _fit(directory, fsdp, f"{folder}/resumed", f"{folder}/run/epoch=0-step={SAVE_EVERY}.ckpt")
    return uninterrupted, resumed


_ONCE: dict[str, object] = {}  # the fits, once for every test of this module (the pools are per test)


@pytest.fixture
def runs(world2, tmp_path_factory):
    """The pretrained directory and, per strategy, the losses of the uninterrupted and the resumed run and
    the folder of their checkpoints."""
    if "runs" in _ONCE:
        return _ONCE["runs"]
    root = tmp_path_factory.mktemp("lora_export")
    directory = save_pretrained("llama", root / "llama")
    (directory / "tokenizer.json").write_text("{}")
    found = {}
    for fsdp in (False, True):
        folder = root / ("fsdp" if fsdp else "ddp")
        found[fsdp] = (*world2.run(_interrupted_and_resumed, directory, fsdp, str(folder))[0], folder)
    _ONCE["runs"] = directory, found
    return _ONCE["runs"]


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp-file", "fsdp-folder"])
def test_a_lora_checkpoint_resumes_exactly_and_holds_the_adapters_optimizer_state(runs, fsdp):
    directory, found = runs
    uninterrupted, resumed, folder = found[fsdp]
    assert sorted(resumed) == list(range(SAVE_EVERY + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6, abs=0), f"step {step}"
    checkpoint = open_checkpoint(folder / "run" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    assert checkpoint.hyper_parameters["config"] == str(directory)  # names its base
    adapters = [n for n in checkpoint.shapes if ".lora_" in n]
    assert len(adapters) == 28  # 2 layers x 7 projections x (A, B)
    if not fsdp:  # the file's AdamW state: the adapters' only
        [optimizer] = torch.load(checkpoint.path, weights_only=False)["optimizer_states"]
        assert len(optimizer["state"]) == len(adapters)


@pytest.fixture
def trained(world2, runs):
    """The FSDP run's last checkpoint and the trained module's logits, through the package at cp 2."""
    if "trained" in _ONCE:
        return _ONCE["trained"]
    directory, found = runs
    checkpoint = found[True][2] / "run" / f"epoch=0-step={STEPS}.ckpt"
    rows = world2.run(sharded_logits, directory, 2, "32-true", checkpoint, True, lora=LORA)[0][0]
    _ONCE["trained"] = directory, checkpoint, rows
    return _ONCE["trained"]


def test_the_merged_export_gives_the_trained_logits(trained, tmp_path):
    directory, checkpoint, rows = trained
    export_hf(checkpoint, tmp_path / "merged")
    index = json.loads((tmp_path / "merged" / "model.safetensors.index.json").read_text())
    assert not [n for n in index["weight_map"] if "lora_" in n or "base_layer" in n]
    assert_logits_of(tmp_path / "merged", rows)
    with pytest.raises(AssertionError):  # the adapters moved the model
        assert_logits_of(directory, rows)


def test_the_adapter_directory_loads_on_the_base_with_the_trained_logits(trained, tmp_path, capsys):
    directory, checkpoint, rows = trained
    output = tmp_path / "adapter"
    assert cli_main(["export-hf", str(checkpoint), str(output), "--adapter"]) == 0
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    assert sorted(p.name for p in output.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
    ]
    config = json.loads((output / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(directory))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="sdpa", dtype=torch.float32
    )
    model = peft.PeftModel.from_pretrained(base, output)
    for ids, logits in rows:
        with torch.no_grad():
            expected = model(input_ids=ids).logits.float()
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_adapter_export_of_a_full_fine_tuning_checkpoint_is_refused(tmp_path):
    torch.save({"state_dict": {}, "hyper_parameters": {"config": CONFIGS["llama"]}}, tmp_path / "full.ckpt")
    with pytest.raises(ValueError, match=r"adapter=True\): the checkpoint is of a run without LoRA"):
        export_hf(tmp_path / "full.ckpt", tmp_path / "out", adapter=True)


def test_a_qlora_checkpoint_is_refused_before_the_first_step_and_when_saved():
    pytest.importorskip("torchao")
    module = HFCausalLM(CONFIGS["llama"], lora=LORA | {"quantize": "nf4"})
    with pytest.raises(
        ValueError, match=r"does not checkpoint QLoRA runs yet: the frozen base is torchao NF4"
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
