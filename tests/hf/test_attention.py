"""``attn_implementation="lightning_cp"``: SDPA without a strategy, exact packed documents under CP, clear errors.

References are ``transformers``' own ``"sdpa"`` models with the same weights, run on whole sequences (or
on each document alone) in this process.
"""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp.hf import check_attention_is_context_parallel
from lightning_cp.hf.attention import hf_context_parallel_attention, mask_for_hf
from lightning_cp.models import GPTConfig, GPTModule, HFCausalLM
from lightning_cp.parallel import current_layout, groups, shard_batch
from lightning_cp.parallel.batch_context import current_batch, set_current_batch
from lightning_cp.parallel.layout import set_current_layout
from tests.hf._models import CONFIGS, VOCAB, build

DOC_LENGTHS = [7, 13, 5, 11]  # odd and unequal: every CP split pads, pieces straddle ranks


@pytest.fixture
def sharded_step():
    """Record a cp=1 sharded batch as a strategy would (``sharded_step(batch)``); forget it afterwards."""

    def record(batch):
        sharded = shard_batch(batch, 1, 0)
        set_current_batch(sharded)
        return sharded

    yield record
    set_current_batch(None)


def _pair(name, **overrides):
    torch.manual_seed(0)
    ours = build(name, "lightning_cp", **overrides)
    reference = build(name, "sdpa", **overrides)
    reference.load_state_dict(ours.state_dict())
    return ours, reference


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", CONFIGS)
def test_without_a_strategy_it_is_sdpa_with_masks_and_packing(name):
    ours, reference = _pair(name)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    left_padded = torch.ones(3, 11, dtype=torch.long)
    left_padded[1, :4] = 0
    packed_positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2]]).expand(3, -1)
    # A padding mask and HF-style packing (detected from position_ids) both go through the mask hook.
    for inputs, valid in (
        ({"attention_mask": left_padded}, left_padded.bool()),
        ({"position_ids": packed_positions}, torch.ones(3, 11, dtype=torch.bool)),
    ):
        weights = torch.randn(3, 11, VOCAB, generator=torch.Generator().manual_seed(2))
        outputs = []
        for model in (ours, reference):
            model.zero_grad()
            logits = model(input_ids=ids, **inputs).logits
            (logits * weights)[valid].sum().backward()
            outputs.append((logits[valid].detach(), _grads(model)))
        (out, grads), (expected, expected_grads) = outputs
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        assert grads.keys() == expected_grads.keys()
        for key, grad in expected_grads.items():
            torch.testing.assert_close(grads[key], grad, rtol=1e-5, atol=1e-6, msg=key)
    assert current_batch() is None


def test_import_registers_lazily():
    code = (
        "import sys, lightning_cp\n"
        "assert 'transformers.modeling_utils' not in sys.modules\n"
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "from lightning_cp.hf.attention import hf_context_parallel_attention, mask_for_hf\n"
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


def test_sliding_window_is_rejected(sharded_step):
    torch.manual_seed(0)
    model = build("qwen3", "lightning_cp", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    batch = sharded_step({"input_ids": torch.randint(0, VOCAB, (2, 9))})
    with pytest.raises(ValueError, match=r"sliding_window=4: .*sliding_window=None"):
        model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])


def test_query_heads_not_a_multiple_of_key_value_heads_is_rejected():
    torch.manual_seed(0)
    model = build("llama", "lightning_cp", num_key_value_heads=3)
    with pytest.raises(
        ValueError, match="4 query heads and 3 key/value heads.*multiple of num_key_value_heads"
    ):
        model(input_ids=torch.randint(0, VOCAB, (1, 6)))


def test_a_sharded_step_rejects_other_tensors_and_masks(sharded_step):
    torch.manual_seed(0)
    model = build("llama", "lightning_cp")
    batch = sharded_step({"input_ids": torch.randint(0, VOCAB, (2, 9))})
    with pytest.raises(ValueError, match="batch holds 20 tokens on this rank"):
        model.model(input_ids=torch.randint(0, VOCAB, (2, 7)))
    mask = torch.zeros(2, 1, 10, 10)
    with pytest.raises(ValueError, match="got an attention mask during a context-parallel step"):
        model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask)


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


def test_hf_causal_lm_with_gradient_checkpointing_recomputes_the_same_packed_step(sharded_step):
    ids = torch.randint(0, VOCAB, (1, sum(DOC_LENGTHS)), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, *DOC_LENGTHS]).cumsum(0).to(torch.int32)
    batch = sharded_step({"input_ids": ids, "cu_seqlens": cu})
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


# --- under CP (gloo pools) ------------------------------------------------------------------------------


def _packed_documents(name, cp):
    """Per-document loss sums and gradients of one packed row, summed over the CP group."""
    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    try:
        torch.manual_seed(0)
        model = build(name, "lightning_cp")
        ids = torch.randint(0, VOCAB, (1, sum(DOC_LENGTHS)), generator=torch.Generator().manual_seed(1))
        cu = torch.tensor([0, *DOC_LENGTHS]).cumsum(0).to(torch.int32)
        batch = shard_batch({"input_ids": ids, "cu_seqlens": cu}, cp, layout.cp_rank)
        set_current_batch(batch)
        hidden = model.model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"]
        ).last_hidden_state
        nll = F.cross_entropy(model.lm_head(hidden)[0], batch["labels"][0], reduction="none")
        document = torch.repeat_interleave(torch.arange(len(DOC_LENGTHS)), batch["cu_seqlens"].diff())
        per_document = torch.zeros(len(DOC_LENGTHS)).index_add(0, document, nll)
        per_document.sum().backward()
        totals = [per_document.detach(), *(p.grad for p in model.parameters())]
        for tensor in totals:
            dist.all_reduce(tensor, group=current_layout().cp_group)
        return totals[0], {k: p.grad for k, p in model.named_parameters()}
    finally:
        set_current_batch(None)
        set_current_layout(None)


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_documents_equal_each_document_alone(world4, name):
    torch.manual_seed(0)
    reference = build(name, "sdpa")
    ids = torch.randint(0, VOCAB, (1, sum(DOC_LENGTHS)), generator=torch.Generator().manual_seed(1))
    sums = []
    for document in ids.split(DOC_LENGTHS, dim=1):
        sums.append(reference(input_ids=document, labels=document).loss * (document.shape[1] - 1))
    torch.stack(sums).sum().backward()
    expected = torch.stack(sums).detach()
    for cp in (2, 4):
        losses, grads = world4.run(_packed_documents, name, cp)[0]
        torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-5, msg=f"cp={cp}")
        for key, param in reference.named_parameters():
            torch.testing.assert_close(grads[key], param.grad, rtol=1e-4, atol=1e-6, msg=f"cp={cp} {key}")


def _without_position_ids(cp):
    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    try:
        torch.manual_seed(0)
        model = build("qwen3", "lightning_cp")
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
        batch = shard_batch({"input_ids": ids}, cp, layout.cp_rank)
        set_current_batch(batch)
        try:
            model.model(input_ids=batch["input_ids"])
        except ValueError as error:
            return str(error)
        return None
    finally:
        set_current_batch(None)
        set_current_layout(None)


def test_a_model_called_without_position_ids_under_cp_fails_on_every_rank(world2):
    for message in world2.run(_without_position_ids, 2):
        assert message is not None and "position_ids=batch['position_ids']" in message
