"""Tiny pretrained directories, and the pool functions that train and run them under the package's strategies.

The checkpoints have non-default rotary frequencies (``rope_theta``, Llama-3 scaling), which a meta-device
build must not lose, and are stored in bfloat16 to be read into fp32 parameters.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy
from lightning_cp.data import collate_padded
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


def _strategy(cp, fsdp):
    return MegatronCPFSDPStrategy(cp=cp) if fsdp else MegatronCPStrategy(cp=cp)


def fit_and_save(directory, cp, fsdp, checkpoint, steps=3):
    """Every rank: fine-tune the pretrained ``directory`` for ``steps`` steps (a high learning rate, so the
    weights move well away from the pretrained ones) and save the checkpoint ``checkpoint``."""
    torch.manual_seed(2)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(2 * steps * dist.get_world_size())]
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=_strategy(cp, fsdp), max_steps=steps)
    loader = DataLoader(data, batch_size=2, collate_fn=collate_padded)
    trainer.fit(HFCausalLM(str(directory), lr=3e-2), loader)
    trainer.save_checkpoint(checkpoint)


class _Logits(HFCausalLM):
    """``predict_step`` returns this rank's logits ``[B, S_local, V]`` and input ids ``[B, S_local]``, the
    rows and dtype of every parameter's local shard (what the rank holds), whether the embedding is tied and
    whether it is an FSDP unit of its own."""

    def on_predict_start(self):
        self.local = {
            n: (len(p.to_local() if isinstance(p, DTensor) else p), len(p), p.dtype)
            for n, p in self.model.named_parameters()
        }
        embedding = self.model.get_input_embeddings()
        self.tied = self.model.get_output_embeddings().weight is embedding.weight
        self.embedding_unit = isinstance(embedding, FSDPModule)

    def predict_step(self, batch, batch_idx):
        weight = self.model.get_output_embeddings().weight
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
        logits = (self(batch) @ weight.T).float()
        tied = self.tied, self.embedding_unit
        return {"logits": logits, "ids": batch["input_ids"], "local": self.local, "tied": tied}


def sharded_logits(directory, cp, precision, ckpt_path=None, fsdp=True, **options):
    """Every rank: predict on one batch per DP rank over DP x CP (FSDP or DDP), from the pretrained
    ``directory`` or the checkpoint ``ckpt_path`` of a module fine-tuned from it (``HFCausalLM``'s ``options``,
    such as ``lora``); returns a list of (full input ids, full logits) per DP rank, and every rank's parameter
    shards."""
    torch.manual_seed(1)
    data = [{"input_ids": torch.randint(0, VOCAB, (SEQ,))} for _ in range(4)]
    dp = dist.get_world_size() // cp
    trainer = quiet_trainer(devices=dist.get_world_size(), strategy=_strategy(cp, fsdp), precision=precision)
    loader = DataLoader(data, batch_size=len(data) // dp, collate_fn=collate_padded)
    [out] = trainer.predict(_Logits(str(directory), **options), loader, ckpt_path=ckpt_path)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    rows = []
    for first in range(0, dist.get_world_size(), cp):  # Megatron's order: a DP rank's CP ranks are adjacent
        shards = gathered[first : first + cp]
        ids = unshard([s["ids"] for s in shards], seq_len=SEQ)
        logits = unshard([s["logits"] for s in shards], seq_len=SEQ)
        rows.append((ids, logits))
    return rows, [(g["local"], g["tied"]) for g in gathered]


def assert_logits_of(directory, rows, dtype=torch.float32):
    """``from_pretrained(directory)`` with ``"sdpa"`` attention gives the logits of ``rows``."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="sdpa", dtype=dtype
    )
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for ids, logits in rows:
        with torch.no_grad():
            expected = reference(input_ids=ids).logits.float()
        torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance)
    return reference


def stored_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of ``directory``, by its stored name, in its stored dtype."""
    from safetensors import safe_open

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return tensors
