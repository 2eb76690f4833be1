"""What ``lightning-cp`` refuses before any rank starts (``lightning_cp.cli.launch_checks``), from the config alone.

Each mistake used to start every rank and end in one refusal per rank (or an ``IndexError`` in the
embedding). The checks are called here on the classes the CLI builds (nothing is launched); two cases run
through the command line, as a user types them: one line on stderr and exit status 2.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from lightning_cp import MegatronCPStrategy, PolicyObjective
from lightning_cp.cli.launch_checks import check_before_launch
from lightning_cp.data import LongRangeDataModule, RolloutDataModule
from lightning_cp.models import GPTConfig, GPTModule, HFCausalLM
from tests.test_cli import HF_CPU, _check_one_line

transformers = pytest.importorskip("transformers")

from tests.hf._families import tiny_config
from tests.hf._models import CONFIGS, VOCAB, build
from tests.hf.test_hybrid import HYBRIDS


def _refusal(model, strategy, datamodule=None, subcommand="fit") -> str | None:
    try:
        check_before_launch(model, datamodule, strategy, subcommand)
    except ValueError as error:
        return str(error)
    return None


def _llama(**fields) -> HFCausalLM:
    return HFCausalLM({**CONFIGS["llama"], **fields})


def test_ulysses_with_heads_that_do_not_split_is_refused_and_auto_falls_back():
    six_heads = _llama(num_attention_heads=6, hidden_size=48)  # 6 query heads, 2 key/value heads
    message = _refusal(six_heads, MegatronCPStrategy(cp=4, cp_attention="ulysses"))
    assert message == (
        "model (LlamaForCausalLM): cp_attention='ulysses' splits the query heads over the CP "
        "ranks, but 6 query heads and 2 key/value heads do not split over cp=4 (query heads a multiple of cp, "
        "key/value heads a multiple or a divisor of it): use cp_attention='allgather' or 'auto', or another cp."
    )
    assert _refusal(six_heads, MegatronCPStrategy(cp=2, cp_attention="ulysses")) is None  # 6 = 3 x 2
    assert _refusal(six_heads, MegatronCPStrategy(cp=4, cp_attention="auto")) is None
    assert _refusal(six_heads, MegatronCPStrategy(cp=4)) is None


@pytest.mark.parametrize(
    ("model_type", "module"),
    [
        ("mamba", "backbone.layers.0.mixer (MambaMixer)"),
        ("falcon_mamba", "backbone.layers.0.mixer (FalconMambaMixer)"),
        ("jamba", "model.layers.0.mamba (JambaMambaMixer)"),
        ("zamba", "model.layers.0.mamba (ZambaMambaMixer)"),
    ],
)
def test_a_mamba1_model_is_refused_under_cp_only(model_type, module):
    model = HFCausalLM(tiny_config(model_type).to_dict())
    message = _refusal(model, MegatronCPStrategy(cp=2))
    assert message.startswith(f"model ({type(build_meta(model_type)).__name__}): {module} is a state-space")
    assert "Mamba1 has no context-parallel forward" in message and "train it with cp=1" in message
    assert _refusal(model, MegatronCPStrategy(cp=1)) is None


def build_meta(model_type: str) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(tiny_config(model_type))


@pytest.mark.parametrize(
    ("name", "fields", "cp", "expected"),
    [
        ("qwen3_5_text", {"linear_num_value_heads": 6}, 4, "value heads=6 is not divisible by cp=4"),
        ("mamba2", {"n_groups": 3, "num_heads": 12, "head_dim": 32, "expand": 6}, 4, "groups=3 for 12 heads"),
        ("lfm2", {"hidden_size": 66}, 4, "hidden_size=66 is not divisible by cp=4"),
    ],
)
def test_hybrid_heads_that_do_not_split_are_refused_with_their_numbers(name, fields, cp, expected):
    message = _refusal(HFCausalLM({**HYBRIDS[name], **fields}), MegatronCPStrategy(cp=cp))
    assert message.startswith("model (") and f"cannot be split over cp={cp} ranks" in message
    assert expected in message
    assert _refusal(HFCausalLM(HYBRIDS[name]), MegatronCPStrategy(cp=cp)) is None


def test_a_family_with_attention_classes_of_its_own_is_refused_under_cp():
    message = _refusal(HFCausalLM(tiny_config("falcon").to_dict()), MegatronCPStrategy(cp=2))
    assert "model (FalconForCausalLM) computes attention in classes of its own" in message


def _pretrained(directory, vocab: int) -> str:
    torch.manual_seed(0)
    build("llama", "sdpa", vocab_size=vocab).save_pretrained(directory)
    return str(directory)


def test_a_pretrained_vocabulary_smaller_than_the_data_s_is_refused(tmp_path):
    directory = _pretrained(tmp_path / "llama", VOCAB)
    model = HFCausalLM(directory)
    data = LongRangeDataModule(vocab_size=VOCAB + 3, seq_len=16, num_train_samples=4, num_val_samples=2)
    message = _refusal(model, MegatronCPStrategy(cp=2), data)
    assert message.startswith(
        f"data.vocab_size={VOCAB + 3} is larger than the model's vocab_size={VOCAB}: token ids up to "
        f"{VOCAB + 2} cannot be embedded. The model is the pretrained {directory!r} (its config.json)"
    )
    assert f"model.resize_token_embeddings({VOCAB + 3})" in message
    same = LongRangeDataModule(vocab_size=VOCAB, seq_len=16, num_train_samples=4, num_val_samples=2)
    assert _refusal(model, MegatronCPStrategy(cp=2), same) is None


def test_a_composite_s_text_vocabulary_is_the_one_compared(tmp_path):
    """A composite directory's config.json keeps the text model's vocabulary in its text_config."""
    directory = tmp_path / "gemma3"
    config = tiny_config("gemma3", text_config={**tiny_config("gemma3_text").to_dict(), "vocab_size": VOCAB})
    config.save_pretrained(directory)
    assert json.loads((directory / "config.json").read_text())["text_config"]["vocab_size"] == VOCAB
    (directory / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    data = LongRangeDataModule(vocab_size=VOCAB + 1, seq_len=16, num_train_samples=4, num_val_samples=2)
    message = _refusal(HFCausalLM(str(directory)), MegatronCPStrategy(cp=1), data)
    assert message.startswith(f"data.vocab_size={VOCAB + 1} is larger than the model's vocab_size={VOCAB}")


def test_a_gpt_vocabulary_smaller_than_the_data_s_is_refused():
    model = GPTModule(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    data = LongRangeDataModule(vocab_size=65, seq_len=16, num_train_samples=4, num_val_samples=2)
    message = _refusal(model, MegatronCPStrategy(cp=2), data)
    assert message.endswith("Set the model's vocab_size to at least 65.")


def _rollout_file(path, reference: bool) -> str:
    """Two groups of two token-id rollouts, with the reference model's log-probs or without them."""
    records = [
        {"prompt_ids": [1 + g, 2], "completion_ids": [3, 4 + k], "reward": float(k)}
        | ({"ref_logprobs": [-0.5, -0.25]} if reference else {})
        for g in range(2)
        for k in range(2)
    ]
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), path)
    else:
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_a_kl_term_without_the_rollouts_reference_log_probs_is_refused(tmp_path):
    """Where the first step (or the sanity check, for val_path) would fail after launch; predict, which
    writes those log-probs, kl_coef=0 and a LoRA model (its base is the reference) are not refused."""
    pytest.importorskip("datasets")
    model = HFCausalLM(CONFIGS["llama"], objective=PolicyObjective(kl_coef=0.1))
    strategy = MegatronCPStrategy(cp=2)
    bare = _rollout_file(tmp_path / "bare.parquet", reference=False)  # columns from the schema
    given = _rollout_file(tmp_path / "given.jsonl", reference=True)  # from the first line

    def refusal(path, val_path=None, subcommand="fit", objective=model):
        data = RolloutDataModule(path, val_path=val_path, cache_dir=str(tmp_path / "cache"))
        return _refusal(objective, strategy, data, subcommand)

    assert refusal(bare) == (
        f"model.objective.kl_coef=0.1 needs the reference model's log-probs of every rollout, which "
        f"data.path={bare!r} does not give (fit reads it): set data.init_args.ref_logprobs to the directory "
        "lightning-cp predict wrote with the reference weights, or give the file a 'ref_logprobs' column; or set "
        "kl_coef: 0."
    )
    assert f"data.val_path={bare!r} does not give (fit reads it)" in refusal(given, val_path=bare)
    assert f"data.val_path={bare!r} does not give (validate reads it)" in refusal(given, bare, "validate")
    assert refusal(given, val_path=given) is None and refusal(bare, given, "validate") is None
    assert refusal(bare, subcommand="predict") is None
    assert refusal(bare, bare, objective=HFCausalLM(CONFIGS["llama"], objective=PolicyObjective())) is None
    # With LoRA the reference is the base model, adapters off, computed in the step.
    lora = HFCausalLM(CONFIGS["llama"], objective=PolicyObjective(kl_coef=0.1), lora={"rank": 4})
    assert refusal(bare, bare, objective=lora) is None


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_evaluating_rollouts_without_a_validation_file_is_refused(subcommand, tmp_path):
    """Lightning would find no loader and end with status 0, having evaluated nothing."""
    pytest.importorskip("datasets")
    data = RolloutDataModule(_rollout_file(tmp_path / "r.jsonl", reference=False))
    message = _refusal(
        GPTModule(GPTConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16)), None, data, subcommand
    )
    assert message == (
        f"data.val_path is not set: {subcommand} runs on RolloutDataModule's validation rollouts only (path is "
        f"the training data), so it would {subcommand} nothing; set data.init_args.val_path to a rollout file."
    )


# --- through the command line: one line, status 2, no rank started -------------------------------------------


def _hf_yaml(tmp_path, model_config, strategy_args, **model_args) -> str:
    tree = yaml.safe_load(HF_CPU.read_text())
    tree["model"]["init_args"].update(config=model_config, **model_args)
    tree["trainer"]["strategy"]["init_args"].update(strategy_args)
    tree["trainer"]["logger"][0]["init_args"]["save_dir"] = str(tmp_path / "logs")
    if "objective" in model_args:  # reinforcement learning: the policy objective on rollouts
        rollouts = _rollout_file(tmp_path / "rollouts.jsonl", reference=False)
        tree["data"] = {"class_path": "lightning_cp.data.RolloutDataModule", "init_args": {"path": rollouts}}
    path = tmp_path / "hf.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


@pytest.mark.parametrize(
    "case", ["ulysses-heads", "pretrained-vocabulary", "kl-without-reference", "validate-without-val_path"]
)
def test_the_command_refuses_before_any_rank_starts(case, tmp_path, cli_before_launch):
    config = yaml.safe_load(HF_CPU.read_text())["model"]["init_args"]["config"]
    subcommand = "validate" if case == "validate-without-val_path" else "fit"
    if case == "ulysses-heads":  # 4 processes, cp = 4: the 6 query heads do not split
        path = _hf_yaml(
            tmp_path,
            {**config, "num_attention_heads": 6, "hidden_size": 96},
            {"cp": 4, "cp_attention": "ulysses"},
        )
        expected = "6 query heads and 2 key/value heads do not split over cp=4"
    elif (
        case == "pretrained-vocabulary"
    ):  # the long-range task's 128 ids against a pretrained 61-token vocabulary
        path = _hf_yaml(tmp_path, _pretrained(tmp_path / "llama", VOCAB), {})
        expected = f"data.vocab_size=128 is larger than the model's vocab_size={VOCAB}"
    else:  # GRPO's KL term on rollouts without reference log-probs; validate with no validation rollouts
        pytest.importorskip("datasets")
        path = _hf_yaml(tmp_path, config, {}, objective={"kl_coef": 0.04})
        expected = "model.objective.kl_coef=0.04 needs" if subcommand == "fit" else "data.val_path is not set"
    assert expected in _check_one_line(*cli_before_launch(subcommand, "--config", path))
