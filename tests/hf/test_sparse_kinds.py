"""Each sparse-attention family's description (:mod:`lightning_cp.hf.sparse_kinds`) against the model
``transformers`` builds from a config of that family: the sizes it reads are those the built indexers hold, and
its sparse and selecting layers those the model has. On ``meta`` builds of the family matrix's configs
(``tests/hf/test_sparse_attention.py``, which trains each family against the unsharded model). The setup checks
refuse the indexers described as refused, under CP only.
"""

from __future__ import annotations

import pytest
import torch

from lightning_cp.hf.check import check_token_mixers
from lightning_cp.hf.sparse_kinds import INDEXERS, REFUSED, indexer_kind
from tests.hf.test_sparse_attention import SPARSE

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", sorted(SPARSE))
def test_each_description_reads_the_sizes_its_model_is_built_with(family):
    config = transformers.AutoConfig.for_model(**SPARSE[family])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    indexers = [module for module in model.modules() if indexer_kind(module) is not None]
    assert indexers, f"{family}: no indexer of {sorted(INDEXERS)}"
    first = indexers[0]
    sizes = indexer_kind(first).sizes(model.config)
    assert (sizes.topk, sizes.heads, sizes.head_dim) == (first.index_topk, first.n_heads, first.head_dim)
    # As built: a sparse layer's attention holds an indexer, or reuses the previous one's selection (skip_topk,
    # its indexer None); dots3's sliding-window attention has neither.
    attentions = [module for module in model.modules() if hasattr(module, "indexer")]
    sparse = [a for a in attentions if a.indexer is not None or getattr(a, "skip_topk", False)]
    assert (sizes.layers, sizes.indexer_layers) == (len(sparse), len(indexers))


def test_the_checks_refuse_a_family_described_as_refused_under_cp_only():
    config = transformers.AutoConfig.for_model(model_type="deepseek_v4", num_hidden_layers=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as refusal:
        check_token_mixers(model, "model", cp=2)
    assert f"(DeepseekV4HCACompressor) {REFUSED['DeepseekV4HCACompressor']}" in str(refusal.value)
    assert "train it with cp=1" in str(refusal.value)
    check_token_mixers(model, "model", cp=1)
