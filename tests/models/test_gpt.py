import pytest
import torch

from lightning_cp.models import GPT, GPTConfig
from lightning_cp.parallel import shard_batch

CONFIG = GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16)


def test_packed_row_equals_each_sequence_on_its_own():
    """Document masking and position ids that restart per sequence: packing changes nothing."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    first, second = torch.randint(0, 50, (6,)), torch.randint(0, 50, (10,))
    packed = shard_batch(
        {"input_ids": torch.cat([first, second])[None], "cu_seqlens": torch.tensor([0, 6, 16])}, 1, 0
    )
    hidden = model(packed["input_ids"], packed["position_ids"], cp_shard=packed["cp_shard"])
    for tokens, start in ((first, 0), (second, 6)):
        alone = model(tokens[None], torch.arange(len(tokens))[None])
        torch.testing.assert_close(hidden[0, start : start + len(tokens)], alone[0], rtol=1e-5, atol=1e-5)


def test_rope_uses_position_ids():
    """RoPE is relative: shifting every position changes nothing, spreading them changes the output."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    ids = torch.randint(0, 50, (1, 8))
    base = model(ids, torch.arange(8)[None])
    torch.testing.assert_close(model(ids, torch.arange(8)[None] + 5), base, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(model(ids, (2 * torch.arange(8))[None]), base, atol=1e-4)


@pytest.mark.parametrize("tie", [True, False])
def test_lm_head_weight(tie):
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, tie_embeddings=tie))
    assert model.lm_head_weight.shape == (50, 16)
    assert (model.lm_head_weight is model.embed.weight) == tie


def test_config_rejects_odd_head_size():
    with pytest.raises(ValueError, match="even head size"):
        GPTConfig(n_embd=18, n_head=2)
