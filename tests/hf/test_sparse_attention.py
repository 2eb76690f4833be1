"""Sparse-attention families (DeepSeek Sparse Attention's lightning indexer and top-k attention) train exactly
under CP.

References are ``transformers``' own models with the same weights and their default attention, which select
with the dense ``[S, S]`` index scores and fold the selection into a dense mask (:mod:`tests.hf._exactness`).
``index_topk`` is 4 so that every query past its fourth token drops keys, with 8 indexer heads so that the
indexer's ReLU rarely ties scores at zero; weights at 10x the default initializer range.

- the family matrix: every adapted family at dp 2 x cp 2 (padded and packed rows) and dp 1 x cp 4 (packed), loss and
  every parameter's gradient against the reference (one training step of ``HFCausalLM``), the indexers' weights
  included (no gradient, as in the model);
- activation checkpointing (one case): the recomputed layers select again;
- through ``Trainer.fit`` under both strategies at cp 2: DDP's unused-parameter check (the frozen indexers) and
  its averaged gradients, FSDP's gathered ones;
- without ``cp_shard`` (``generate``): the adapted model equals its eager attention, prefill and decoding;
- refusals: the composites without a causal LM name their indexers (Qwen4's and DeepSeek-V4's refusals are in
  the family matrix, ``tests/hf/test_families.py``).

Every rank's selected keys of every query against a dense selection: ``tests/parallel/test_sparse_attention.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_cp.hf.indexers import INDEXERS, adapt_indexers
from tests.hf import _exactness

transformers = pytest.importorskip("transformers")

_MLA = {
    "vocab_size": _exactness.VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_topk": 4,
    "index_head_dim": 16,
    "index_n_heads": 8,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": _exactness.INIT,
}
SPARSE: dict[str, dict] = {
    "deepseek_v32": {
        "model_type": "deepseek_v32",
        **_MLA,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
    },
    "glm_moe_dsa": {  # a layer that reuses the previous layer's selection
        "model_type": "glm_moe_dsa",
        **_MLA,
        "num_hidden_layers": 3,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "indexer_types": ["full", "shared", "full"],
    },
    "axk2": {
        "model_type": "axk2",
        **_MLA,
        "num_hidden_layers": 2,
        "gated_norm_rank": 4,
        "mlp_layer_types": ["dense", "sparse"],
    },
    "hy_v4": {  # rotary dims last, fp32 key norm, attention sinks, shared selections (F, F, S)
        "model_type": "hy_v4",
        **_MLA,
        "num_hidden_layers": 3,
        "hc_mult": 2,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
    },
    "dots3_note_text": {  # indexed layers beside sliding-window MLA layers
        "model_type": "dots3_note_text",
        **_MLA,
        "num_hidden_layers": 3,
        "head_dim": 24,
        "shared_experts_intermediate_size": 32,
        "sliding_window": 4,
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 32,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 24,
        "swa_qk_nope_head_dim": 16,
        "swa_v_head_dim": 16,
    },
}


# cp 2 beside DP on padded and packed rows, cp 4 on packed documents (split in more, smaller chunks); the cp 2
# packed case with activation checkpointing: the backward's recomputation of each layer runs its indexer again
# (lent the shard by the layer's hooks), and the shared layers get the previous layer's selection as an input.
@pytest.mark.parametrize(
    ("cp", "packed", "checkpointing"),
    [(2, False, False), (2, True, True), (4, True, False)],
    ids=["dp2-cp2-padded", "dp2-cp2-packed-checkpointed", "dp1-cp4-packed"],
)
def test_every_sparse_family_trains_as_the_unsharded_model(world4, cp, packed, checkpointing):
    results = world4.run(_exactness.train_step, SPARSE, cp, packed, gradient_checkpointing=checkpointing)[0]
    assert set(results) == set(SPARSE)
    failures = _exactness.failures(results)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_every_sparse_family_trains_through_the_strategies(world2, fsdp):
    # The indexers take no part in the loss: DDP's unused-parameter check stopped every family at its first step.
    results = world2.run(_exactness.fit_step, SPARSE, 2, fsdp)[0]
    assert set(results) == set(SPARSE)
    failures = _exactness.failures(results)
    assert not failures, "\n".join(failures)


def test_every_indexer_is_in_the_matrix():
    built = set()
    for config in SPARSE.values():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
        built |= {type(m).__name__ for m in model.modules()}
    assert set(INDEXERS) <= built


@pytest.mark.parametrize(
    ("model_type", "indexer"),
    [("glm5_next", "Glm5NextTextIndexer"), ("mistral_large4", "MistralLarge4TextIndexer")],
)
def test_composites_without_a_causal_lm_are_refused_with_their_indexer(model_type, indexer):
    from lightning_cp.models import HFCausalLM

    with pytest.raises(ValueError, match=f"no causal-LM class.*its {indexer} is a sparse-attention indexer"):
        HFCausalLM({"model_type": model_type})


@pytest.mark.parametrize("name", ["deepseek_v32", "hy_v4"])
def test_without_a_shard_the_model_generates_as_its_eager_attention(name):
    """No ``cp_shard`` (``generate``, a callback): the indexer runs on the dense mask and the attention folds its
    selection into it, prefill and decoding with a cache alike."""

    def build(implementation: str):  # a config each: a model keeps its config's attn_implementation
        config = transformers.AutoConfig.for_model(**SPARSE[name])
        return transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=implementation
        ).eval()

    torch.manual_seed(0)
    ours, eager = build("lightning_cp"), build("eager")
    assert ours.config._attn_implementation == "lightning_cp"
    assert adapt_indexers(ours)  # what the strategy's setup does (prepare_models)
    eager.load_state_dict(ours.state_dict())
    ids = torch.randint(3, _exactness.VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(
            ours.generate(ids, max_new_tokens=6, do_sample=False),
            eager.generate(ids, max_new_tokens=6, do_sample=False),
        )


def test_indices_no_adapted_indexer_selected_are_refused():
    """A selection the CP indexer did not make for this shard (an indexer that scored this rank's keys only) is
    refused, not attended to."""
    from torch import nn

    from lightning_cp.hf.attention import hf_context_parallel_attention
    from lightning_cp.parallel import CPShard, CPSplit

    shard = CPShard.build(CPSplit(1, 0), torch.tensor([6]), "cpu")
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    local = torch.zeros(1, 6, 2, dtype=torch.int32)  # what transformers' own indexer returns
    with pytest.raises(ValueError, match="did not select for this batch's shard"):
        hf_context_parallel_attention(nn.Module(), q, k, v, None, cp_shard=shard, indices=local)


def test_minimax_m3_s_block_sparse_layers_are_its_sdpa_without_a_shard_and_refused_with_one():
    """MiniMax-M3's sparse layers hand the attention ``block_indices`` (blocks of keys, per key/value head). Without
    ``cp_shard`` the attention folds them into the mask as the model's SDPA path does; with a shard (any ``cp``) it
    refuses them rather than attend densely, and the setup checks refuse the indexer by name under CP."""
    from lightning_cp.hf.check import check_token_mixers
    from lightning_cp.parallel import shard_batch

    def build(implementation: str):
        config = transformers.AutoConfig.for_model(
            "minimax_m3_vl_text",
            vocab_size=_exactness.VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            layer_types=["full_attention", "minimax_m3_sparse"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            index_n_heads=2,
            index_head_dim=8,
            index_block_size=2,
            index_topk_blocks=2,
            index_local_blocks=1,
        )
        return transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=implementation
        ).eval()

    torch.manual_seed(0)
    ours, sdpa = build("lightning_cp"), build("sdpa")
    sdpa.load_state_dict(ours.state_dict())
    ids = torch.randint(3, _exactness.VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = sdpa(ids, use_cache=False).logits
        torch.testing.assert_close(ours(ids, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)
        batch = shard_batch({"input_ids": ids}, 1, 0)
        with pytest.raises(ValueError, match="passed block_indices=.*block-sparse key selection"):
            ours.model(
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                cp_shard=batch["cp_shard"],
                use_cache=False,
            )
    with pytest.raises(ValueError, match="MiniMaxM3VLIndexer"):
        check_token_mixers(ours, "model", cp=2)
