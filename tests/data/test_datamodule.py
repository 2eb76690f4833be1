import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from jsonargparse import ArgumentParser
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from lightning_cp.data import LongRangeCopyDataset, LongRangeDataModule, TokenFileDataModule, write_token_file
from tests.data._megatron import megatron_documents, random_documents, write_megatron_dataset


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


def _samples(dm, packed, batch_size, pad_id) -> list[list[int]]:
    """The ids of every sample of the train then validation loaders, in order, after checking each batch's
    form: every real token is a target, and padding (``pad_id``) is not."""
    samples = []
    for batch in [*dm.train_dataloader(), *dm.val_dataloader()]:
        if packed:
            _check_packed(batch)
            assert batch["loss_mask"].tolist() == [[1.0] * batch["input_ids"].shape[1]]
            cu = batch["cu_seqlens"].tolist()
            samples += [batch["input_ids"][0, a:b].tolist() for a, b in itertools.pairwise(cu)]
        else:
            _check_padded(batch, batch_size)
            mask = batch["loss_mask"].bool()
            assert bool((batch["input_ids"][~mask] == pad_id).all()) and bool(mask[:, 0].all())
            samples += [row[row_mask].tolist() for row, row_mask in zip(batch["input_ids"], mask)]
    return samples


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
    samples = _samples(dm, packed, batch_size=3, pad_id=4)
    assert [t for sample in samples for t in sample] == tokens.tolist()


def test_token_file_windows_split_into_train_and_val_tail(tmp_path):
    tokens = np.arange(105) % 50
    path = tmp_path / "tok.bin"
    write_token_file(path, tokens, vocab_size=50)
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
    dm = TokenFileDataModule(str(path), vocab_size=20, seq_len=10, dtype="uint16", val_fraction=0.9)
    with pytest.raises(ValueError, match="of the 2 samples .* leaves no training sample"):
        dm.setup("fit")


@pytest.mark.parametrize("packed", [False, True])
def test_megatron_dataset_documents_cover_it_exactly_once(tmp_path, packed):
    rng = np.random.default_rng(3)
    prefix = write_megatron_dataset(
        tmp_path / "train_text_document", random_documents(rng, 60, 1000), np.uint16
    )
    dm = TokenFileDataModule(
        prefix,
        vocab_size=1000,
        seq_len=6,
        val_fraction=0.1,
        batch_size=3,
        packed=packed,
        shuffle=False,
        pad_id=7,
    )
    dm.setup("fit")
    expected = [
        p for doc in megatron_documents(prefix) for p in (doc[i : i + 6] for i in range(0, len(doc), 6))
    ]
    num_val = round(0.1 * len(expected))
    assert (len(dm._train), len(dm._val)) == (len(expected) - num_val, num_val)
    assert _samples(dm, packed, batch_size=3, pad_id=7) == expected


def test_megatron_dataset_takes_its_dtype_and_documents_from_the_index(tmp_path):
    prefix = write_megatron_dataset(tmp_path / "corpus", [[[1, 2, 3]], [[4, 5]]] * 4, np.int32)
    with pytest.raises(
        ValueError, match=r"eos_id=3: the documents .* come from .*corpus.idx; leave eos_id unset"
    ):
        TokenFileDataModule(prefix, vocab_size=10, eos_id=3)
    with pytest.raises(ValueError, match=r"dtype='uint32' contradicts .*corpus.idx, which records int32 ids"):
        TokenFileDataModule(prefix, vocab_size=10, dtype="uint32")
    with pytest.raises(ValueError, match=f"one of the two files .*pass the prefix, path='{prefix}'"):
        TokenFileDataModule(prefix + ".bin", vocab_size=10, dtype="uint16")
    with pytest.raises(ValueError, match="seq_len=0 must be at least 1"):
        TokenFileDataModule(prefix, vocab_size=10, seq_len=0)
    Path(prefix + ".bin").write_bytes(b"\x00" * 4)
    with pytest.raises(ValueError, match="the two files do not belong together"):
        TokenFileDataModule(prefix, vocab_size=10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"path": "no/such/dir/tok.bin"}, r"path='no/such/dir/tok.bin' does not exist"),
        ({"dtype": None}, "no sidecar .* pass dtype='uint16' or dtype='uint32'"),
        ({"seq_len": 0}, "seq_len=0 must be at least 1"),
        ({"seq_len": 500}, "holds 400 tokens, fewer than one window of seq_len=500"),
        ({"eos_id": 70_000}, "eos_id=70000 is not a valid id"),
    ],
)
def test_token_file_mistakes_fail_in_the_constructor(tmp_path, kwargs, match):
    """So that ``lightning-cp`` reports them as one line instead of a traceback per rank from ``setup``."""
    path = tmp_path / "tok.bin"
    (np.arange(400) % 50).astype(np.uint32).tofile(path)
    kwargs = {"path": str(path), "vocab_size": 50, "seq_len": 10, "dtype": "uint32", **kwargs}
    with pytest.raises(ValueError, match=match):
        TokenFileDataModule(**kwargs)


def test_uint32_file_configured_as_uint16_fails_in_the_constructor(tmp_path):
    path = tmp_path / "tok.bin"
    np.random.default_rng(0).integers(0, 50, size=4000).astype(np.uint32).tofile(path)
    with pytest.raises(ValueError, match=r"looks like a uint32 file.*Pass dtype='uint32'"):
        TokenFileDataModule(str(path), vocab_size=50, seq_len=10, dtype="uint16")


def test_token_file_dtype_that_contradicts_the_sidecar_fails_in_the_constructor(tmp_path):
    path = tmp_path / "tok.bin"
    write_token_file(path, np.arange(400) % 50, vocab_size=50)
    with pytest.raises(ValueError, match=r"dtype='uint32' contradicts the sidecar"):
        TokenFileDataModule(str(path), vocab_size=50, seq_len=10, dtype="uint32")


@pytest.mark.parametrize("megatron", [False, True])
def test_out_of_vocab_ids_in_the_sample_fail_in_the_constructor_the_others_at_setup(tmp_path, megatron):
    tokens = np.arange(200_000) % 1000
    sampled, unsampled = 199_999, 20_000  # the sample: 16 blocks of 4096 ids, from the first id to the last
    tokens[unsampled] = 5000
    if megatron:
        path = write_megatron_dataset(tmp_path / "corpus", [tokens], np.int32)
    else:
        path = str(tmp_path / "tok.bin")
        tokens.astype(np.uint16).tofile(path)
    kwargs = {"path": path, "vocab_size": 1000, "seq_len": 100, "dtype": None if megatron else "uint16"}
    dm = TokenFileDataModule(**kwargs)
    with pytest.raises(ValueError, match=r"holds token id 5000 \(at position 20000\).*vocab_size=1000"):
        dm.setup("fit")
    tokens[sampled] = 7000
    if megatron:
        write_megatron_dataset(tmp_path / "corpus", [tokens], np.int32)
    else:
        tokens.astype(np.uint16).tofile(path)
    with pytest.raises(ValueError, match=r"holds token id 7000 \(at position 199999\).*at least 7001"):
        TokenFileDataModule(**kwargs)


def test_uint16_file_configured_as_uint32_fails_in_the_constructor(tmp_path):
    path = tmp_path / "tok.bin"
    (np.arange(4000) % 50 + 1).astype(np.uint16).tofile(path)
    as_uint32 = np.fromfile(path, dtype=np.uint32)  # ids 1..50 pairwise, e.g. (2, 3) -> 3 * 65536 + 2
    biggest = f"holds token id {as_uint32.max()} \\(at position {as_uint32.argmax()}\\)"
    with pytest.raises(ValueError, match=biggest + ".*really holds uint32 ids"):
        TokenFileDataModule(str(path), vocab_size=50, seq_len=10, dtype="uint32")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 127}, "seq_len=127 must be an even number"),
        ({"min_len": 7}, "min_len=7 must be an even number"),
        ({"min_len": 300}, "min_len=300 is larger than seq_len=256"),
        ({"vocab_size": 1}, "vocab_size=1 must be at least 2"),
        ({"num_train_samples": 0}, "num_train_samples=0 must be at least 1"),
        ({"num_val_samples": 0}, "num_val_samples=0 must be at least 1"),
    ],
)
def test_long_range_mistakes_fail_in_the_constructor(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LongRangeDataModule(**kwargs)


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
