"""``attn_implementation="lightning_cp"``: ``"sdpa"`` without ``cp_shard``, the shard's attention with it.

References are ``transformers``' own ``"sdpa"`` models with the same weights, run on whole sequences (or
on each document alone), and an explicit-mask softmax; everything here runs in one process (a batch
sharded for CP rank 0 of 2 needs no process group until its attention communicates).
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_cp.hf import check_attention_is_context_parallel, decoder
from lightning_cp.hf.attention import hf_context_parallel_attention
from lightning_cp.hf.masks import mask_for_hf
from lightning_cp.models import GPTConfig, GPTModule, HFCausalLM
from lightning_cp.parallel import shard_batch, unshard
from tests.hf._models import CONFIGS, VARIANTS, VOCAB, assert_grads_close, build, build_variant

DOC_LENGTHS = [7, 13, 5, 11]  # odd and unequal: every CP split pads, pieces straddle ranks


def _pair(name, **overrides):
    torch.manual_seed(0)
    ours = build(name, "lightning_cp", **overrides)
    reference = build(name, "sdpa", **overrides)
    reference.load_state_dict(ours.state_dict())
    return ours, reference


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _packed_inputs():
    ids = torch.randint(0, VOCAB, (1, sum(DOC_LENGTHS)), generator=torch.Generator().manual_seed(1))
    return ids, torch.tensor([0, *DOC_LENGTHS]).cumsum(0).to(torch.int32)


def _packed_batch(cp, rank):
    ids, cu = _packed_inputs()
    return shard_batch({"input_ids": ids, "cu_seqlens": cu}, cp, rank)


def _decoder(model, batch, **kwargs):
    return model.model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **kwargs
    )


_MODELS = {  # variant: the config of tests/hf/_models.py it starts from, and what it changes
    **{name: (name, {}) for name in CONFIGS},
    # Layer 0 full attention, layer 1 a 4-token sliding window: both of transformers' mask builders.
    "qwen3-sliding": ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "mistral-sliding": ("llama", {"model_type": "mistral", "sliding_window": 4}),
}


@pytest.mark.parametrize("variant", _MODELS)
def test_without_cp_shard_it_is_sdpa_with_masks_and_packing(variant):
    name, overrides = _MODELS[variant]
    ours, reference = _pair(name, **overrides)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    left_padded = torch.ones(3, 11, dtype=torch.long)
    left_padded[1, :4] = 0
    packed_positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]]).expand(3, -1)
    # A padding mask and HF-style packing (detected from position_ids) both go through the mask hook.
    for inputs, valid in (
        ({"attention_mask": left_padded}, left_padded.bool()),
        ({"position_ids": packed_positions}, torch.ones(3, 11, dtype=torch.bool)),
    ):
        weights = torch.randn(3, 11, VOCAB, generator=torch.Generator().manual_seed(2))
        outputs = []
        for model in (ours, reference):
            model.zero_grad()
            logits = model(input_ids=ids, use_cache=False, **inputs).logits  # no cache: packing detected
            (logits * weights)[valid].sum().backward()
            outputs.append((logits[valid].detach(), _grads(model)))
        (out, grads), (expected, expected_grads) = outputs
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        assert grads.keys() == expected_grads.keys()
        for key, grad in expected_grads.items():
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_is_sdpa(cache):
    # A static cache makes generate() build the masks ahead of the forward and treat them as tensors.
    ours, reference = _pair("llama")
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    options = {
        "max_new_tokens": 4,
        "do_sample": False,
        "output_scores": True,
        "return_dict_in_generate": True,
    }
    if cache == "static":
        options["cache_implementation"] = "static"
    out, expected = (model.generate(prompt, attention_mask=mask, **options) for model in (ours, reference))
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(expected.scores), rtol=1e-5, atol=1e-5)


def test_with_cp_shard_no_mask_is_built(monkeypatch):
    import transformers.masking_utils

    def refuse(**kwargs):
        raise AssertionError("sdpa_mask was called")

    model, _ = _pair("qwen3")
    batch = _packed_batch(1, 0)  # positions restart per document: transformers sees a packed row
    monkeypatch.setattr(transformers.masking_utils, "sdpa_mask", refuse)
    _decoder(model, batch, cp_shard=batch["cp_shard"])
    with pytest.raises(AssertionError, match="sdpa_mask was called"):
        _decoder(model, batch)  # the same model without the shard builds its mask


def test_at_cp1_without_cp_shard_a_sharded_batch_is_plain_sdpa():
    # At cp = 1 every rank holds whole sequences: SDPA with transformers' packed mask is exact.
    model, _ = _pair("llama")
    batch = _packed_batch(1, 0)
    with_shard = _decoder(model, batch, cp_shard=batch["cp_shard"]).last_hidden_state
    torch.testing.assert_close(_decoder(model, batch).last_hidden_state, with_shard, rtol=1e-5, atol=1e-6)


def test_a_cp_batch_without_cp_shard_is_refused_other_tensors_are_not():
    model, reference = _pair("qwen3")
    batch = _packed_batch(2, 0)
    with pytest.raises(ValueError, match=r"without its shard.*cp_shard=batch\['cp_shard'\]"):
        _decoder(model, batch)
    other = torch.randint(0, VOCAB, batch["input_ids"].shape)  # same shape, not the batch
    torch.testing.assert_close(
        model(input_ids=other).logits, reference(input_ids=other).logits, rtol=1e-5, atol=1e-6
    )


class _Layer(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_layer_scaling_is_used(packed):
    # Padded rows take the fused whole-row kernel, packed documents the variable-length one.
    lengths = [4, 6, 2] if packed else [8, 8]  # even: no CP padding at cp = 1
    rows, total = (1, sum(lengths)) if packed else (len(lengths), lengths[0])
    batch = {"input_ids": torch.zeros(rows, total, dtype=torch.long)}
    if packed:
        batch["cu_seqlens"] = torch.tensor([0, *lengths]).cumsum(0)
    shard = shard_batch(batch, 1, 0)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(rows, 4, total, 8, generator=generator)
    k, v = (torch.randn(rows, 2, total, 8, generator=generator) for _ in range(2))
    scale = 1.0  # the default would be 8 ** -0.5
    out, _ = hf_context_parallel_attention(
        _Layer(), q, k, v, None, scaling=scale, cp_shard=shard["cp_shard"], position_ids=shard["position_ids"]
    )
    document = (
        torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths)) if packed else torch.zeros(total)
    )
    allowed = (document[:, None] == document[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * scale
    expected = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_import_registers_lazily():
    code = (
        "import sys, lightning_cp\n"
        "assert 'transformers.modeling_utils' not in sys.modules\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "from lightning_cp.hf.attention import hf_context_parallel_attention\n"
        "from lightning_cp.hf.masks import mask_for_hf\n"
        "assert AttentionInterface._global_mapping['lightning_cp'] is hf_context_parallel_attention\n"
        "assert AttentionMaskInterface._global_mapping['lightning_cp'] is mask_for_hf\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_install_registers_into_loaded_modules_at_once():
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from lightning_cp.hf import registration

    for interface in (AttentionInterface, AttentionMaskInterface):
        interface._global_mapping.pop("lightning_cp", None)
    registration.install()
    assert AttentionInterface._global_mapping["lightning_cp"] is hf_context_parallel_attention
    assert AttentionMaskInterface._global_mapping["lightning_cp"] is mask_for_hf


def test_hf_causal_lm_loads_a_local_pretrained_directory(tmp_path):
    torch.manual_seed(0)
    saved = build("llama", "sdpa")
    saved.save_pretrained(tmp_path)
    module = HFCausalLM(str(tmp_path))
    module.configure_model()
    assert module.model.config._attn_implementation == "lightning_cp"
    for key, value in saved.state_dict().items():
        torch.testing.assert_close(module.model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    with pytest.raises(ValueError, match="not a local directory"):
        HFCausalLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no 'model_type'"):
        HFCausalLM({"hidden_size": 32})


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_layer_variant_reaches_the_shard_s_attention(variant):
    # At cp = 1 (one process): packed documents with cp_shard against each document alone through the
    # family's default attention (the window, softcap, scaling, sinks and value head dim of each layer).
    torch.manual_seed(0)
    ours = build_variant(variant, "lightning_cp")
    reference = build_variant(variant, None)
    reference.load_state_dict(ours.state_dict())
    ids, cu_seqlens = _packed_inputs()
    batch = shard_batch({"input_ids": ids, "cu_seqlens": cu_seqlens}, 1, 0)
    hidden = decoder(ours)(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        cp_shard=batch["cp_shard"],
        use_cache=False,
    ).last_hidden_state
    hidden = unshard([hidden], cu_seqlens=cu_seqlens)  # without the padding of the split
    upstream = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(2))
    (hidden * upstream).sum().backward()
    documents = ids.split(DOC_LENGTHS, dim=1)
    expected = torch.cat(
        [decoder(reference)(input_ids=d, use_cache=False).last_hidden_state for d in documents], 1
    )
    (expected * upstream).sum().backward()
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(_grads(ours), _grads(reference))


def test_query_heads_not_a_multiple_of_key_value_heads_is_rejected():
    torch.manual_seed(0)
    model = build("llama", "lightning_cp", num_key_value_heads=3)
    batch = shard_batch({"input_ids": torch.randint(0, VOCAB, (1, 6))}, 1, 0)
    with pytest.raises(
        ValueError, match="4 query heads and 3 key/value heads.*multiple of num_key_value_heads"
    ):
        _decoder(model, batch, cp_shard=batch["cp_shard"])


def test_cp_shard_rejects_other_tensors_masks_and_positions():
    torch.manual_seed(0)
    model = build("llama", "lightning_cp")
    batch = shard_batch({"input_ids": torch.randint(0, VOCAB, (2, 9))}, 1, 0)
    shard = batch["cp_shard"]
    with pytest.raises(ValueError, match="cp_shard holds 20 tokens on this rank"):
        model.model(input_ids=torch.randint(0, VOCAB, (2, 7)), cp_shard=shard)
    padding = torch.ones(2, 10, dtype=torch.long)
    padding[1, -2:] = 0
    for mask in (padding, torch.zeros(2, 1, 10, 10)):  # 2-D padding, 4-D
        with pytest.raises(ValueError, match="got an attention mask with cp_shard"):
            _decoder(model, batch, cp_shard=shard, attention_mask=mask)
    _decoder(model, batch, cp_shard=shard, attention_mask=torch.ones(2, 10))  # masks nothing: accepted
    shifted = batch["position_ids"] + 1
    with pytest.raises(ValueError, match=r"position_ids=batch\['position_ids'\]"):
        model.model(input_ids=batch["input_ids"], position_ids=shifted, cp_shard=shard)
    same_values = batch["position_ids"].clone()  # another tensor, the same positions: accepted
    model.model(input_ids=batch["input_ids"], position_ids=same_values, cp_shard=shard)


def test_setup_check_flags_local_attention_only():
    torch.manual_seed(0)
    sdpa = build("qwen3", "sdpa")
    with pytest.raises(
        ValueError, match=r"cp=2.*model \(transformers attn_implementation='sdpa'\).*\"lightning_cp\""
    ):
        check_attention_is_context_parallel(torch.nn.ModuleDict({"model": sdpa}), 2)
    mha = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.MultiheadAttention(8, 2))
    with pytest.raises(ValueError, match=r"1 \(torch.nn.MultiheadAttention\)"):
        check_attention_is_context_parallel(mha, 4)
    check_attention_is_context_parallel(sdpa, 1)  # no CP: every attention is exact
    check_attention_is_context_parallel(build("qwen3", "lightning_cp"), 2)
    check_attention_is_context_parallel(GPTModule(GPTConfig(vocab_size=VOCAB, n_layer=1, n_embd=16)), 2)


def test_hf_causal_lm_with_gradient_checkpointing_recomputes_the_same_packed_step():
    batch = _packed_batch(1, 0)
    grads = []
    for checkpointing in (False, True):
        module = HFCausalLM(CONFIGS["qwen3"], gradient_checkpointing=checkpointing)
        torch.manual_seed(0)
        module.configure_model()
        hidden = module(batch)
        nll = F.cross_entropy(module.model.lm_head(hidden)[0], batch["labels"][0], reduction="sum")
        nll.backward()
        grads.append(_grads(module.model))
    assert module.model.model.gradient_checkpointing and module.model.training
    for key, grad in grads[0].items():
        torch.testing.assert_close(grads[1][key], grad, rtol=1e-5, atol=1e-7, msg=key)


_OWN_ATTENTION_CLASSES = """
import importlib, sys
first, model_types = sys.argv[1], sys.argv[2:]
modeling = [f"transformers.models.{t}.modeling_{t}" for t in model_types]
for name in (modeling + ["lightning_cp"] if first == "transformers" else ["lightning_cp"] + modeling):
    importlib.import_module(name)
from transformers import AutoModelForCausalLM
from tests.hf._families import tiny_config
for model_type in model_types:
    try:
        AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="lightning_cp")
    except ValueError as error:
        print(model_type, type(error).__name__, error)
"""


@pytest.mark.parametrize("first", ["transformers", "lightning_cp"])
def test_a_family_with_attention_classes_of_its_own_is_refused_with_the_reason_not_a_key_error(first):
    """Falcon and GPT-Neo pick attention classes from tables of their own: asked for "lightning_cp" they raised
    KeyError('lightning_cp') inside transformers. Their modeling modules loaded before or after the package."""
    command = [sys.executable, "-c", _OWN_ATTENTION_CLASSES, first, "falcon", "gpt_neo"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split(" ", 2)[:2] for line in out] == [
        ["falcon", "UnsupportedAttentionClasses"],
        ["gpt_neo", "UnsupportedAttentionClasses"],
    ]
    assert "FALCON_ATTENTION_CLASSES: 'eager', 'sdpa', 'flash_attention_2'" in out[0] and "cp=1" in out[0]
