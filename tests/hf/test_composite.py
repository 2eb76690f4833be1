"""Multimodal composite checkpoints: the text model trains, the export is the composite again.

A tiny Qwen3.5 (Gated DeltaNet) and a tiny Gemma-3 composite, each a vision tower beside its language model,
are saved by ``transformers``' ``save_pretrained``; ``HFCausalLM(directory)`` fine-tunes the text model under
``MegatronCPFSDPStrategy`` at cp 2 on packed chat rows (targets on the replies only), each rank reading its
shards of the composite's files; ``export_hf`` writes the composite back. The reference is
``transformers``' own composite class loaded from the export, on text: it must give the trained text model's
logits (rebuilt from ``full_state_dict()``), and the vision tower's tensors must be the input's, byte for byte.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from lightning_cp import MegatronCPFSDPStrategy, export_hf
from lightning_cp.data import collate_packed
from lightning_cp.hf.composite import stored_tensor_names
from lightning_cp.hf.loading import load_pretrained
from lightning_cp.models import HFCausalLM
from tests._trainer import quiet_trainer
from tests.hf._pretrained import stored_tensors

transformers = pytest.importorskip("transformers")

VOCAB = 120
_TEXT_SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
}
_QWEN3_5_TEXT = {
    **_TEXT_SIZES,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "layer_types": ["linear_attention", "full_attention"],
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
}
COMPOSITES = {
    "qwen3_5": {
        "text_config": _QWEN3_5_TEXT,
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "num_position_embeddings": 64,
        },
        "image_token_id": 116,
        "video_token_id": 117,
        "vision_start_token_id": 118,
        "vision_end_token_id": 119,
    },
    "gemma3": {
        "text_config": {
            **_TEXT_SIZES,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 4,
        },
        "mm_tokens_per_image": 4,
        "image_token_index": 116,
        "boi_token_index": 117,
        "eoi_token_index": 118,
    },
}
_TEXT_IDS = 100  # text tokens only (no image or special token of the composites)


def save_composite(model_type: str, directory) -> None:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **COMPOSITES[model_type])
    model = transformers.AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():  # 10x the default initializer range: what training changes is visible
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(directory)


def _chat_rows(count: int) -> list[dict[str, torch.Tensor]]:
    """Conversations: a prompt (no target) then a reply (targets), of unequal lengths."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(count):
        prompt, reply = 5 + i % 4, 7 + (3 * i) % 5
        ids = torch.randint(3, _TEXT_IDS, (prompt + reply,), generator=g)
        rows.append({"input_ids": ids, "loss_mask": torch.cat([torch.zeros(prompt), torch.ones(reply)])})
    return rows


class _WholeWeights(Callback):
    def on_train_end(self, trainer, pl_module):
        self.weights = trainer.strategy.full_state_dict()  # every rank takes part; rank 0 gets them


def _fit(directory, checkpoint) -> dict:
    whole = _WholeWeights()
    strategy = MegatronCPFSDPStrategy(cp=2)
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=strategy, max_steps=3, callbacks=[whole])
    module = HFCausalLM(str(directory), lr=3e-2)
    trainer.fit(module, DataLoader(_chat_rows(12), batch_size=4, collate_fn=collate_packed))
    trainer.save_checkpoint(checkpoint)  # after fit, as users do (the next case's fit must not mind)
    return {"weights": whole.weights, "class": type(module.model).__name__}


@pytest.mark.parametrize("model_type", list(COMPOSITES))
def test_a_composite_trains_its_text_model_and_exports_the_composite(model_type, world2, tmp_path):
    directory, checkpoint, export = tmp_path / model_type, tmp_path / "fsdp.ckpt", tmp_path / "export"
    save_composite(model_type, directory)
    trained = world2.run(_fit, directory, checkpoint)[0]
    text_config = transformers.AutoConfig.from_pretrained(directory).get_text_config()
    assert trained["class"] == transformers.AutoModelForCausalLM._model_mapping[type(text_config)].__name__

    export_hf(checkpoint, export)
    composite = transformers.AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    assert type(composite).__name__.endswith("ForConditionalGeneration")
    text_model = transformers.AutoModelForCausalLM.from_config(text_config)
    text_model.load_state_dict({k.removeprefix("model."): v for k, v in trained["weights"].items()})
    ids = torch.randint(3, _TEXT_IDS, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = text_model(input_ids=ids).logits
        got = composite(input_ids=ids).logits
        before = transformers.AutoModelForImageTextToText.from_pretrained(directory)(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (before - expected).abs().max() > 1e-2  # the export holds the trained weights

    source, written = stored_tensors(directory), stored_tensors(export)
    assert source.keys() == written.keys()
    towers = [k for k in source if "language_model" not in k and k != "lm_head.weight"]
    assert len(towers) > 10 and all("visual" in k or "vision" in k or "projector" in k for k in towers)
    for key in towers:
        assert source[key].dtype == written[key].dtype and torch.equal(
            source[key].view(torch.uint8), written[key].view(torch.uint8)
        ), key


def test_load_pretrained_of_a_composite_is_its_text_model_with_the_composite_s_weights(tmp_path):
    for model_type in COMPOSITES:
        directory = tmp_path / model_type
        save_composite(model_type, directory)
        model = load_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
        composite = transformers.AutoModelForImageTextToText.from_pretrained(
            directory, attn_implementation="sdpa"
        )
        ids = torch.randint(3, _TEXT_IDS, (1, 13), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, composite(input_ids=ids).logits)
        assert len(stored_tensor_names(directory)) > len(model.state_dict())  # the towers are not loaded
        assert not any("vision" in name for name in model.state_dict())
