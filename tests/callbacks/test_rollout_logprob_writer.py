"""``RolloutLogprobWriter``: ``predict`` on a rollout file at cp = 2 (packed, through ``lightning-cp predict``) and
at dp = 2 (padded) writes every completion token's log-probability, equal to ``log_softmax`` of the full sequence's logits on one process, and
``RolloutDataModule(ref_logprobs=...)`` puts each one back on its token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_cp.callbacks import RolloutLogprobWriter
from lightning_cp.cli.lightning_cli import main
from lightning_cp.constants import LOSS_MASK, REF_LOGPROBS
from lightning_cp.data import RolloutDataModule
from lightning_cp.models import HFCausalLM
from tests._trainer import cp_trainer
from tests.hf._models import VOCAB
from tests.hf._pretrained import save_pretrained

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

SEQ_LEN = 32


def _rollouts() -> list[dict]:
    """Seven rollouts (an odd number: the DP ranks predict unequal shares) of unequal lengths, two groups."""
    generator = torch.Generator().manual_seed(0)
    records = []
    for index in range(7):
        prompt = torch.randint(1, VOCAB, (3 + index % 3,), generator=generator).tolist()
        completion = torch.randint(1, VOCAB, (2 + (index * 3) % 8,), generator=generator).tolist()
        records.append(
            {
                "prompt_ids": prompt,
                "completion_ids": completion,
                "reward": float(index % 4),
                "group": index % 2,
            }
        )
    return records


def _predict(model_dir: str, path: str, out: str, cp: int, packed: bool, cache_dir: str) -> None:
    """Every rank: ``trainer.predict`` of the rollout file under ``MegatronCPStrategy(cp=cp)``, written by a
    ``RolloutLogprobWriter`` to ``out``."""
    data = RolloutDataModule(path, seq_len=SEQ_LEN, packed=packed, batch_size=2, cache_dir=cache_dir)
    trainer = cp_trainer(cp, callbacks=[RolloutLogprobWriter(out)])
    trainer.predict(HFCausalLM(model_dir), datamodule=data, return_predictions=False)


def _predict_command(model_dir: str, path: str, out: str, cp: int, packed: bool, cache_dir: str) -> None:
    """Every rank: the same through ``lightning-cp predict``, which picks the writer for a RolloutDataModule
    (writing under ``default_root_dir``, the parent of ``out``, without a logger)."""
    strategy = {"class_path": "lightning_cp.MegatronCPStrategy", "init_args": {"cp": cp}}
    data = {"path": path, "seq_len": SEQ_LEN, "packed": packed, "batch_size": 2, "cache_dir": cache_dir}
    main(
        [
            "predict",
            "--model", json.dumps({"class_path": "lightning_cp.models.HFCausalLM", "init_args": {"config": model_dir}}),
            "--data", json.dumps({"class_path": "lightning_cp.data.RolloutDataModule", "init_args": data}),
            "--trainer.accelerator", "cpu",
            "--trainer.devices", str(dist.get_world_size()),
            "--trainer.strategy", json.dumps(strategy),
            "--trainer.logger", "false",
            "--trainer.default_root_dir", str(Path(out).parent),
            "--trainer.enable_progress_bar", "false",
        ]
    )  # fmt: skip


@pytest.mark.parametrize(("cp", "packed", "run"), [(2, True, _predict_command), (1, False, _predict)])
def test_predicted_logprobs_are_the_full_sequence_s_and_read_back_on_their_tokens(
    world2, tmp_path, cp, packed, run
):
    model_dir = save_pretrained("llama", tmp_path / "model", dtype=torch.float32)
    records = _rollouts()
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    out, cache = tmp_path / "predictions", tmp_path / "cache"
    world2.run(run, str(model_dir), str(path), str(out), cp, packed, str(cache))

    parts = sorted(out.glob("logprobs.dp*.jsonl"))
    assert [part.name for part in parts] == [f"logprobs.dp{r}.jsonl" for r in range(2 // cp)]
    written = [json.loads(line) for part in parts for line in part.read_text().splitlines()]
    assert sorted(entry["rollout"] for entry in written) == list(range(len(records)))
    by_rollout = {entry["rollout"]: entry for entry in written}

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="sdpa", dtype=torch.float32
    )
    expected = []
    for index, record in enumerate(records):
        ids = torch.tensor(record["prompt_ids"] + record["completion_ids"])
        with torch.no_grad():
            logprobs = reference(input_ids=ids[None]).logits[0].log_softmax(-1)
        start = len(record["prompt_ids"])
        expected.append(logprobs[start - 1 : -1].gather(-1, ids[start:, None])[:, 0])
        assert by_rollout[index]["tokens"] == ids.tolist()
        torch.testing.assert_close(
            torch.tensor(by_rollout[index]["logprobs"]), expected[-1], rtol=1e-5, atol=1e-6
        )

    data = RolloutDataModule(
        str(path),
        seq_len=SEQ_LEN,
        packed=False,
        batch_size=len(records),
        ref_logprobs=str(out),
        cache_dir=str(cache),
    )
    data.setup("predict")
    [batch] = list(data.predict_dataloader())
    for row, values in enumerate(expected):
        target = batch[LOSS_MASK][row] == 1
        torch.testing.assert_close(batch[REF_LOGPROBS][row][target], values, rtol=1e-5, atol=1e-6)
        assert (batch[REF_LOGPROBS][row][~target] == 0).all()


def test_a_batch_without_rollout_index_is_refused(tmp_path):
    writer = RolloutLogprobWriter(tmp_path / "out")
    batch = {"input_ids": torch.arange(8)[None], "labels": torch.arange(8)[None]}
    with pytest.raises(
        ValueError, match=r"has no 'rollout_index' .* predict with a RolloutDataModule, or write with "
    ):
        writer.write_on_batch_end(None, None, {}, None, batch, 3)
