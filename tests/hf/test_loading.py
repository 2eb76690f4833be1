"""Pretrained models from a local directory: checked at construction, loaded shard by shard under FSDP.

The reference is ``transformers``' own ``from_pretrained`` with ``"sdpa"`` attention on the whole
sequence: the logits of the sharded, context-parallel model (reassembled from its CP shards) must equal
its logits (the checkpoints of :mod:`tests.hf._pretrained`).
"""

import re

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy
from lightning_cp.cli import main as cli_main
from lightning_cp.data import collate_padded
from lightning_cp.hf.loading import check_causal_lm_config
from lightning_cp.models import HFCausalLM
from tests._trainer import quiet_trainer
from tests.hf._families import tiny_config
from tests.hf._models import VOCAB, build
from tests.hf._pretrained import SEQ, assert_logits_of, save_pretrained, sharded_logits

transformers = pytest.importorskip("transformers")

# --- configuration errors at construction -----------------------------------------------------------------


def _message(config):
    with pytest.raises(ValueError) as error:
        HFCausalLM(config)
    message = str(error.value)
    assert "\n" not in message and len(message) < 400
    return message


def test_unknown_model_type_names_the_closest_known_types():
    message = _message({"model_type": "qwen9", "hidden_size": 32})
    assert "model_type 'qwen9' is not a model type of transformers" in message and "'qwen3'" in message


def test_model_type_without_a_causal_lm_class_is_refused():
    assert "'vit' has no causal-LM class" in _message({"model_type": "vit"})


def test_dict_without_model_type_is_refused():
    assert "has no 'model_type'" in _message({"hidden_size": 32})


def test_directory_mistakes_are_refused(tmp_path):
    assert "not a local directory" in _message(str(tmp_path / "missing"))
    assert "has no config.json" in _message(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    message = _message(str(tmp_path))
    assert "no *.safetensors weights" in message and "pytorch_model.bin" in message
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text('{"model_type": "llamaa"}')
    assert "'llamaa' is not a model type" in _message(str(tmp_path))


def test_a_saved_model_passes_the_check(tmp_path):
    check_causal_lm_config(str(save_pretrained("llama", tmp_path / "llama")))


def test_a_truncated_safetensors_file_is_named_with_its_sizes(tmp_path):
    directory = save_pretrained("llama", tmp_path / "llama")
    file = directory / "model.safetensors"
    whole = file.read_bytes()
    file.write_bytes(whole[:-1000])  # an interrupted copy: the header is whole, the last tensor is cut
    message = _message(str(directory))
    assert f"model.safetensors is {len(whole) - 1000} bytes, but its header describes {len(whole)}" in message
    assert "truncated" in message and "copy it again" in message
    file.write_bytes(whole[:100])  # cut inside the header
    assert "model.safetensors is 100 bytes, shorter than its header" in _message(str(directory))
    file.write_bytes((8).to_bytes(8, "little") + b"not json" + whole)  # not a safetensors file
    assert "model.safetensors does not start with a safetensors header" in _message(str(directory))
    file.write_bytes(whole + b"\0")
    assert (
        f"is {len(whole) + 1} bytes, but its header describes {len(whole)}: the file is damaged"
        in _message(str(directory))
    )


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(tmp_path):
    directory = tmp_path / "llama"
    torch.manual_seed(0)
    build("llama", "sdpa").save_pretrained(directory, max_shard_size="20KB")
    shards = sorted(directory.glob("model-*.safetensors"))
    assert len(shards) > 2
    check_causal_lm_config(str(directory))
    shards[1].unlink()
    message = _message(str(directory))
    assert f"model.safetensors.index.json names {shards[1].name}, which the directory lacks" in message


def test_cli_reports_an_unknown_model_type_as_one_line(capfd):
    with pytest.raises(SystemExit) as exit_:
        cli_main(
            [
                "fit",
                "--model",
                "lightning_cp.models.HFCausalLM",
                "--model.init_args.config.model_type",
                "qwen9",
            ]
        )
    err = capfd.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1
    assert err[0].startswith("lightning-cp: error: ") and "'qwen9' is not a model type" in err[0]


# --- sharded loading under FSDP and CP --------------------------------------------------------------------


def _check_against_from_pretrained(pool, directory, cp, precision="32-true"):
    rows, shards = pool.run(sharded_logits, directory, cp, precision)[0]
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    reference = assert_logits_of(directory, rows, dtype)
    world = pool.world_size
    for local, (tied, embedding_unit) in shards:
        assert tied == reference.config.tie_word_embeddings
        assert embedding_unit == (not tied)  # gathered only to be used, unless the head reads it
        for name, (held, rows, param_dtype) in local.items():  # FSDP shards dim 0
            assert param_dtype == dtype, name
            assert held <= -(-rows // world), f"{name}: {held} of {rows} rows on one of {world} ranks"


@pytest.mark.parametrize("name", ["llama", "qwen3"], ids=["untied", "tied"])
def test_sharded_load_at_dp1_cp2_gives_from_pretrained_logits(name, world2, tmp_path):
    _check_against_from_pretrained(world2, save_pretrained(name, tmp_path / name), cp=2)


@pytest.mark.parametrize("name", ["llama", "qwen3"], ids=["untied", "tied"])
def test_sharded_load_at_dp2_cp2_gives_from_pretrained_logits(name, world4, tmp_path):
    _check_against_from_pretrained(world4, save_pretrained(name, tmp_path / name), cp=2)


def test_sharded_load_keeps_bf16_weights_under_bf16_true(world2, tmp_path):
    _check_against_from_pretrained(
        world2, save_pretrained("qwen3", tmp_path / "q"), cp=2, precision="bf16-true"
    )


def test_rotary_buffers_matter_for_the_check(tmp_path):
    """The check above fails if the rotary frequencies were the default ones (as a meta-device build that
    recomputed nothing, or from a default config, would have them)."""
    directory = save_pretrained("llama", tmp_path / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
    ids = torch.randint(0, VOCAB, (1, SEQ))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        rotary = model.model.rotary_emb
        rotary.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
        assert not torch.allclose(model(input_ids=ids).logits, expected, rtol=1e-3, atol=1e-3)


def test_sharded_load_refuses_a_checkpoint_of_another_shape(world2, tmp_path):
    directory = save_pretrained("llama", tmp_path / "llama")
    config = transformers.AutoConfig.from_pretrained(directory)
    config.intermediate_size = 48
    config.save_pretrained(directory)
    for message in world2.run(_load_error, directory):  # every rank refuses, before any collective
        assert re.search(r"holds model\.layers\.0\.mlp\.\w+_proj\.weight \(\d+, \d+\)", message), message


def test_a_model_loaded_shard_by_shard_is_probed(world2, tmp_path):
    """No rank holds the model whole, yet the setup probe runs (on the sharded model, after loading): a
    family whose recurrence sees one shard (RecurrentGemma's RG-LRU, which only the probe finds) is refused,
    on every rank, before any step."""
    torch.manual_seed(0)
    directory = tmp_path / "recurrent_gemma"
    transformers.AutoModelForCausalLM.from_config(tiny_config("recurrent_gemma")).save_pretrained(directory)
    for message in world2.run(_load_error, directory):
        assert message is not None and "is a recurrent layer" in message, message


def _load_error(directory):
    """The message of the ``ValueError`` the sharded load of ``directory`` raises on this rank, if any."""
    try:
        sharded_logits(directory, 2, "32-true")
    except ValueError as error:
        return str(error)
    return None


# --- a pretrained model trains in training mode -----------------------------------------------------------


class _ModeAndRecomputation(HFCausalLM):
    """Records, at every training batch, whether the model is in training mode and how many times layer 0's
    MLP ran in the batch's step (twice with transformers' gradient checkpointing: forward and recomputation)."""

    def configure_model(self):
        super().configure_model()
        self.seen = []
        self.calls = 0

        mlp = self.model.model.layers[0].mlp
        forward = mlp.forward

        def counted(*args, **kwargs):  # a forward hook would not see the recomputation
            self.calls += 1
            return forward(*args, **kwargs)

        mlp.forward = counted

    def on_train_batch_start(self, batch, batch_idx):
        self.calls = 0

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append((self.model.training, self.calls))


def _modes_and_recomputations(directory, fsdp):
    torch.manual_seed(0)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(4)]
    strategy = (MegatronCPFSDPStrategy if fsdp else MegatronCPStrategy)(cp=2)
    module = _ModeAndRecomputation(str(directory), gradient_checkpointing=True)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=2)
    trainer.fit(module, DataLoader(data, batch_size=2, collate_fn=collate_padded))
    return module.seen


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_a_pretrained_model_trains_in_training_mode_with_its_checkpointing(world2, tmp_path, fsdp):
    """from_pretrained returns eval mode, and Lightning keeps the modes it finds: under DDP the model trained
    without dropout and without transformers' gradient checkpointing (which runs `if self.training`)."""
    directory = save_pretrained("llama", tmp_path / "llama")
    for seen in world2.run(_modes_and_recomputations, directory, fsdp):
        assert seen == [(True, 2), (True, 2)]
