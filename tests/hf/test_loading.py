"""Pretrained models from a local directory: checked at construction, loaded shard by shard under FSDP.

The reference is ``transformers``' own ``from_pretrained`` with ``"sdpa"`` attention on the whole
sequence: the logits of the sharded, context-parallel model (reassembled from its CP shards) must equal
its logits. The checkpoints have non-default rotary frequencies (``rope_theta``, Llama-3 scaling), which a
meta-device build must not lose, and are stored in bfloat16 to be read into fp32 parameters.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_cp import MegatronCPFSDPStrategy
from lightning_cp.cli import main as cli_main
from lightning_cp.data import collate_padded
from lightning_cp.hf.loading import check_causal_lm_config
from lightning_cp.models import HFCausalLM
from lightning_cp.parallel import unshard
from tests._trainer import quiet_trainer
from tests.hf._models import VOCAB, build

transformers = pytest.importorskip("transformers")

SEQ = 24
ROPE = {
    "llama": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 5000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "qwen3": {"rope_parameters": {"rope_type": "default", "rope_theta": 300.0}},
}


def save_pretrained(name, directory, dtype=torch.bfloat16, seed=0):
    """A tiny ``name`` model (qwen3: tied embeddings; llama: untied) saved as safetensors in ``dtype``."""
    torch.manual_seed(seed)
    model = build(name, "sdpa", **ROPE[name])
    model.to(dtype).save_pretrained(directory)
    return directory


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


class _Logits(HFCausalLM):
    """``predict_step`` returns this rank's logits ``[B, S_local, V]`` and input ids ``[B, S_local]``, and the
    rows and dtype of every parameter's local shard (what the rank holds)."""

    def on_predict_start(self):
        self.local = {n: (len(p.to_local()), len(p), p.dtype) for n, p in self.model.named_parameters()}
        self.tied = self.model.get_output_embeddings().weight is self.model.get_input_embeddings().weight

    def predict_step(self, batch, batch_idx):
        weight = self.model.get_output_embeddings().weight
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
        logits = (self(batch) @ weight.T).float()
        return {"logits": logits, "ids": batch["input_ids"], "local": self.local, "tied": self.tied}


def _sharded_logits(directory, cp, precision):
    """Every rank: FSDP over DP x CP predicts on one batch per DP rank; returns, on rank 0, a list of
    (full input ids, full logits) per DP rank, and every rank's parameter shards."""
    torch.manual_seed(1)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(4)]
    dp = dist.get_world_size() // cp
    trainer = quiet_trainer(
        devices=dist.get_world_size(), strategy=MegatronCPFSDPStrategy(cp=cp), precision=precision
    )
    module = _Logits(str(directory))
    loader = DataLoader(data, batch_size=len(data) // dp, collate_fn=collate_padded)
    [out] = trainer.predict(module, loader)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    rows = []
    for first in range(
        0, dist.get_world_size(), cp
    ):  # Megatron's order: the CP ranks of a DP rank are adjacent
        shards = gathered[first : first + cp]
        ids = unshard([s["ids"] for s in shards], seq_len=SEQ)
        logits = unshard([s["logits"] for s in shards], seq_len=SEQ)
        rows.append((ids, logits))
    return rows, [(g["local"], g["tied"]) for g in gathered]


def _check_against_from_pretrained(pool, directory, cp, precision="32-true"):
    results = pool.run(_sharded_logits, directory, cp, precision)
    rows, shards = results[0]
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="sdpa", dtype=dtype
    )
    for ids, logits in rows:
        with torch.no_grad():
            expected = reference(input_ids=ids).logits.float()
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance)
    world = pool.world_size
    for local, tied in shards:
        assert tied == reference.config.tie_word_embeddings
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
    with pytest.raises(RuntimeError, match=r"holds model\.layers\.0\.mlp\.\w+_proj\.weight \(\d+, \d+\)"):
        world2.run(_sharded_logits, directory, 2, "32-true")
