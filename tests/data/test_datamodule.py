import numpy as np
import pytest
import torch
from jsonargparse import ArgumentParser
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from lightning_cp.data import LongRangeCopyDataset, LongRangeDataModule, TokenFileDataModule


def _check_padded(batch, batch_size):
    assert set(batch) == {"input_ids", "loss_mask", "input_mask"}
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].dim() == 2
    assert batch["input_ids"].shape[0] <= batch_size
    assert batch["loss_mask"].shape == batch["input_ids"].shape


def _check_packed(batch):
    assert set(batch) == {"input_ids", "loss_mask", "cu_seqlens"}
    ids, cu = batch["input_ids"], batch["cu_seqlens"]
    assert ids.dtype == torch.int64 and ids.shape[0] == 1
    assert batch["loss_mask"].shape == ids.shape
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == ids.shape[1]
    assert bool((cu.diff() > 0).all())


def test_long_range_padded_batches_are_the_dataset_samples():
    dm = LongRangeDataModule(
        vocab_size=64, seq_len=8, num_train_samples=10, num_val_samples=3, batch_size=4, shuffle=False, seed=5
    )
    dm.setup("fit")
    assert dm.vocab_size == 64
    train = list(dm.train_dataloader())
    assert [b["input_ids"].shape[0] for b in train] == [4, 4, 2]
    reference = LongRangeCopyDataset(num_samples=10, seq_len=8, vocab_size=64, seed=5)
    for k, batch in enumerate(train):
        _check_padded(batch, 4)
        rows = range(4 * k, 4 * k + batch["input_ids"].shape[0])
        assert torch.equal(batch["input_ids"], torch.stack([reference[i]["input_ids"] for i in rows]))
        assert torch.equal(batch["loss_mask"], torch.stack([reference[i]["loss_mask"] for i in rows]))
    (val,) = list(dm.val_dataloader())
    val_reference = LongRangeCopyDataset(num_samples=3, seq_len=8, vocab_size=64, seed=5 + 10)
    assert torch.equal(val["input_ids"], torch.stack([val_reference[i]["input_ids"] for i in range(3)]))
    train_rows = {tuple(r.tolist()) for b in train for r in b["input_ids"]}
    assert not train_rows & {tuple(r.tolist()) for r in val["input_ids"]}


def test_long_range_packed_batches_hold_unequal_sequences():
    dm = LongRangeDataModule(
        vocab_size=64,
        seq_len=16,
        min_len=4,
        num_train_samples=12,
        num_val_samples=4,
        batch_size=4,
        packed=True,
        shuffle=False,
    )
    dm.setup("fit")
    reference = LongRangeCopyDataset(num_samples=12, seq_len=16, vocab_size=64, min_len=4)
    for k, batch in enumerate(dm.train_dataloader()):
        _check_packed(batch)
        samples = [reference[i] for i in range(4 * k, 4 * k + 4)]
        assert batch["cu_seqlens"].diff().tolist() == [s["input_ids"].numel() for s in samples]
        assert torch.equal(batch["input_ids"][0], torch.cat([s["input_ids"] for s in samples]))
        assert torch.equal(batch["loss_mask"][0], torch.cat([s["loss_mask"] for s in samples]))
    lengths = {n for b in dm.train_dataloader() for n in b["cu_seqlens"].diff().tolist()}
    assert len(lengths) > 1
    for batch in dm.val_dataloader():
        _check_packed(batch)


def test_loaders_leave_distributed_sampling_to_lightning():
    dm = LongRangeDataModule(seq_len=8, num_train_samples=8, num_val_samples=2, batch_size=2)
    with pytest.raises(RuntimeError, match="call setup\\('fit'\\)"):
        dm.train_dataloader()
    dm.setup("fit")
    train, val = dm.train_dataloader(), dm.val_dataloader()
    assert isinstance(train.sampler, RandomSampler)  # Lightning maps this to DistributedSampler(shuffle=True)
    assert isinstance(val.sampler, SequentialSampler)
    assert not isinstance(train.sampler, DistributedSampler) and train.batch_size == 2


@pytest.mark.parametrize("packed", [False, True])
def test_token_file_documents_cover_the_file_exactly_once(tmp_path, packed):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5, size=300)  # eos_id=0
    path = tmp_path / "tok.bin"
    tokens.astype(np.uint32).tofile(path)
    dm = TokenFileDataModule(
        str(path),
        vocab_size=5,
        seq_len=8,
        dtype="uint32",
        eos_id=0,
        val_fraction=0.1,
        batch_size=3,
        packed=packed,
        shuffle=False,
        pad_id=4,
    )
    dm.setup("fit")
    assert dm.vocab_size == 5
    seen = []
    for batch in [*dm.train_dataloader(), *dm.val_dataloader()]:
        if packed:
            _check_packed(batch)
            assert batch["loss_mask"].tolist() == [[1.0] * batch["input_ids"].shape[1]]
            seen.append(batch["input_ids"][0])
        else:
            _check_padded(batch, 3)
            mask = batch["loss_mask"].bool()
            assert bool((batch["input_ids"][~mask] == 4).all())  # pad_id where nothing is scored
            seen.append(batch["input_ids"][mask])  # row-major: samples in order
    assert torch.cat(seen).tolist() == tokens.tolist()


def test_token_file_windows_split_into_train_and_val_tail(tmp_path):
    tokens = np.arange(105) % 50
    path = tmp_path / "tok.bin"
    tokens.astype(np.uint16).tofile(path)
    dm = TokenFileDataModule(
        str(path), vocab_size=50, seq_len=10, val_fraction=0.2, batch_size=4, shuffle=False
    )
    dm.setup("fit")
    train = torch.cat([b["input_ids"] for b in dm.train_dataloader()])
    val = torch.cat([b["input_ids"] for b in dm.val_dataloader()])
    assert train.tolist() == tokens[:80].reshape(8, 10).tolist()
    assert val.tolist() == tokens[80:100].reshape(2, 10).tolist()


def test_token_file_val_fraction_errors(tmp_path):
    path = tmp_path / "tok.bin"
    np.arange(20, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="val_fraction=0.0 must be in \\(0, 1\\)"):
        TokenFileDataModule(str(path), vocab_size=20, val_fraction=0.0)
    dm = TokenFileDataModule(str(path), vocab_size=20, seq_len=10, val_fraction=0.9)
    with pytest.raises(ValueError, match="of the 2 samples .* leaves no training sample"):
        dm.setup("fit")


def test_cli_arguments_come_from_the_signatures(tmp_path):
    parser = ArgumentParser()
    parser.add_class_arguments(TokenFileDataModule, "data")
    cfg = parser.parse_args(
        ["--data.path=tok.bin", "--data.vocab_size=100", "--data.dtype=uint32", "--data.packed=true"]
    )
    assert cfg.data.dtype == "uint32" and cfg.data.packed is True and cfg.data.batch_size == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["--data.path=tok.bin", "--data.vocab_size=100", "--data.dtype=int8"])
    help_text = parser.format_help()
    assert "samples per batch on each data-parallel rank" in help_text


@pytest.mark.parametrize("stage", ["test", "predict"])
def test_test_and_predict_use_the_held_out_split(stage):
    dm = LongRangeDataModule(vocab_size=64, seq_len=8, num_train_samples=10, num_val_samples=3, batch_size=2)
    dm.setup(stage)
    loader = getattr(dm, f"{stage}_dataloader")()
    assert isinstance(loader.sampler, SequentialSampler)
    expected = [dm._val[i]["input_ids"] for i in range(3)]
    got = [row for batch in loader for row in batch["input_ids"]]
    assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, expected))
