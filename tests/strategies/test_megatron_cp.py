"""MegatronCPStrategy end to end: the same training as a plain single-process PyTorch loop.

One pool of 2 and one of 4 gloo ranks run every layout; the reference is a hand-written loop
(``F.cross_entropy`` on materialized logits, token mean over the global batch, the same AdamW).
"""

import copy
import itertools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_cp import CPLossMixin, MegatronCPStrategy
from lightning_cp.data import LongRangeCopyDataset, collate_packed, collate_padded
from lightning_cp.models import GPT, GPTConfig, GPTModule
from lightning_cp.parallel import CPShard, CPSplit, ParallelLayout, current_layout
from tests._trainer import cp_trainer as _trainer

CONFIG = GPTConfig(vocab_size=61, n_layer=2, n_head=2, n_embd=32)
GLOBAL_BATCH = 4
STEPS = 5
LR = 1e-2
METRIC_KEYS = (
    "loss",
    "ppl",
    "accuracy",
    "entropy",
    "target_tokens",
    "input_tokens",
    "seq_ppl_mean",
    "seq_ppl_min",
    "seq_ppl_max",
)


class _FirstTokenTargets(torch.utils.data.Dataset):
    """The copy task with every sample's first token marked as a target too.

    No token precedes it in its own document, so it must never be predicted: in a packed row the token
    before it is the previous document's last, and a label that crossed the boundary would show up here
    as a different loss (the reference scores every document alone).

    With ``one_target_first_step``, the first optimizer step (the training sampler's first ``GLOBAL_BATCH``
    samples) has one target in all, token 5 of its last sample: its first micro-batches and all ranks but one
    have none (Megatron-LM #7513: a CP-local mean would give that token a 1 / |DP x CP| share).
    """

    def __init__(self, samples, one_target_first_step=False):
        self.samples = samples
        self.only_target = {}  # sample index -> its one target position, or None for no target
        if one_target_first_step:
            # Lightning's training sampler: seed 0, the same permutation for any number of replicas.
            first = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0))[:GLOBAL_BATCH]
            self.only_target = {**dict.fromkeys(first[:-1].tolist()), first[-1].item(): 5}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        sample = dict(self.samples[index])
        sample["loss_mask"] = sample["loss_mask"].clone()
        sample["loss_mask"][0] = 1
        if index in self.only_target:
            sample["loss_mask"].zero_()
            if self.only_target[index] is not None:
                sample["loss_mask"][self.only_target[index]] = 1
        return sample


def _dataset(num_samples=GLOBAL_BATCH * STEPS, seed=3, one_target_first_step=False):
    # Unequal lengths: packed pieces straddle CP ranks and every rank holds a different number of targets.
    return _FirstTokenTargets(
        LongRangeCopyDataset(
            num_samples=num_samples, seq_len=26, vocab_size=CONFIG.vocab_size, seed=seed, min_len=10
        ),
        one_target_first_step,
    )


def _loader(batch_size, packed, dataset=None):
    return DataLoader(
        dataset or _dataset(),
        batch_size=batch_size,
        shuffle=False,
        collate_fn=collate_packed if packed else collate_padded,
    )


class _Recorder(Callback):
    def __init__(self):
        self.losses = []
        self.val_losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.losses.append(trainer.callback_metrics["train/loss_step"].item())

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val_losses.append(trainer.callback_metrics["val/loss"].item())


def _fit(cp, packed, accumulate=1, one_target_first_step=False):
    """Train STEPS optimizer steps; return per-step losses, final weights and epoch metrics."""
    world = dist.get_world_size()
    dp = world // cp
    seed_everything(0)
    module = GPTModule(CONFIG, lr=LR)
    recorder = _Recorder()
    trainer = _trainer(cp, world, max_steps=STEPS, accumulate_grad_batches=accumulate, callbacks=[recorder])
    micro_batch = GLOBAL_BATCH // dp // accumulate
    data = _dataset(GLOBAL_BATCH * STEPS, one_target_first_step=one_target_first_step)
    trainer.fit(
        module,
        _loader(micro_batch, packed, data),
        _loader(micro_batch, packed, _dataset(GLOBAL_BATCH, seed=9)),
    )
    metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
    weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return recorder.losses, weights, metrics


def _targets(batch, packed):
    """Next-token labels (-100 where not a target), position ids and rows of the padded reference."""
    if not packed:
        ids, mask = batch["input_ids"], batch["loss_mask"].bool()
        rows = list(zip(ids, mask))
    else:
        cu = batch["cu_seqlens"].tolist()
        rows = [
            (batch["input_ids"][0, a:b], batch["loss_mask"][0, a:b].bool()) for a, b in itertools.pairwise(cu)
        ]
    width = max(len(ids) for ids, _ in rows)
    width += width % 2
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for r, (row_ids, row_mask) in enumerate(rows):
        n = len(row_ids)
        ids[r, :n] = row_ids
        for t in range(n - 1):
            if row_mask[t + 1]:
                labels[r, t] = row_ids[t + 1]
    return ids, labels


def _reference(
    packed,
    steps=STEPS,
    clip=None,
    compute_dtype=None,
    gradients=None,
    moments=None,
    one_target_first_step=False,
):
    """Per-step losses and final weights of a plain loop; ``clip``: clip the global gradient norm to it.

    ``compute_dtype``: each forward and backward through a copy of the weights in it (``bf16-mixed`` under
    FSDP), its gradients applied to the fp32 weights, the logits upcast as the fused loss does.
    ``gradients``: a dict to fill with the last step's gradients, by parameter name; ``moments``: one to fill
    with AdamW's final ``(exp_avg, exp_avg_sq)``, by parameter name."""
    seed_everything(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    # Lightning gives training loaders a shuffling DistributedSampler (seed 0 here); its permutation does
    # not depend on the number of replicas, so every layout sees the same global batches as this one.
    data = _dataset(one_target_first_step=one_target_first_step)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(
        data,
        batch_size=GLOBAL_BATCH,
        sampler=sampler,
        collate_fn=collate_packed if packed else collate_padded,
    )
    for step, batch in enumerate(loader):
        if step == steps:
            break
        ids, labels = _targets(batch, packed)
        compute = model if compute_dtype is None else copy.deepcopy(model).to(compute_dtype)
        hidden = compute(ids, torch.arange(ids.shape[1]).expand_as(ids))
        logits = (hidden @ compute.lm_head_weight.T).float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        for param, low in zip(model.parameters(), compute.parameters(), strict=True):
            param.grad = low.grad.float()
        if gradients is not None:
            gradients.update({name: param.grad.clone() for name, param in model.named_parameters()})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        losses.append(loss.item())
    if moments is not None:
        state = optimizer.state
        moments.update(
            {n: (state[p]["exp_avg"], state[p]["exp_avg_sq"]) for n, p in model.named_parameters()}
        )
    return losses, model.state_dict()


def _reference_validation(weights, packed):
    """Validation metrics of the trained reference weights, computed by hand on materialized logits."""
    model = GPT(CONFIG)
    model.load_state_dict(weights)
    batch = next(iter(_loader(GLOBAL_BATCH, packed, _dataset(GLOBAL_BATCH, seed=9))))
    ids, labels = _targets(batch, packed)
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids)) @ model.lm_head_weight.T
    valid = labels != -100
    loss = F.cross_entropy(logits[valid], labels[valid])
    # One perplexity per sequence (a document when packed), from its own tokens only.
    per_sequence = [
        F.cross_entropy(row_logits[row_valid], row_labels[row_valid]).exp().item()
        for row_logits, row_labels, row_valid in zip(logits, labels, valid)
        if row_valid.any()
    ]
    return {
        "val/seq_ppl_mean": sum(per_sequence) / len(per_sequence),
        "val/seq_ppl_min": min(per_sequence),
        "val/seq_ppl_max": max(per_sequence),
        "val/loss": loss.item(),
        "val/ppl": loss.exp().item(),
        "val/accuracy": (logits[valid].argmax(-1) == labels[valid]).float().mean().item(),
        "val/target_tokens": valid.sum().item(),
        "val/input_tokens": batch["input_ids"].numel() if packed else batch["input_mask"].sum().item(),
    }


def _run_layouts(cps, packed, accumulate=1, one_target_first_step=False):
    return {cp: _fit(cp, packed, accumulate, one_target_first_step) for cp in cps}


def _check_against_reference(results, packed):
    ref_losses, ref_weights = _reference(packed)
    ref_validation = _reference_validation(ref_weights, packed)
    for cp, (losses, weights, metrics) in results.items():
        assert len(losses) == STEPS
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6, msg=f"cp={cp}"
        )
        for name, value in ref_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=f"cp={cp} {name}")
        for name, value in ref_validation.items():
            assert metrics[name] == pytest.approx(value, rel=1e-4), f"cp={cp} {name}"
    # The weights must actually move, or comparing them says little.
    seed_everything(0)
    initial = GPT(CONFIG).state_dict()
    assert (
        max((ref_weights[k] - initial[k]).abs().max().item() for k in initial) > 2 * LR
    )  # Adam moves a weight by at most ~LR a step


def _check_metrics_equal(results, reference_metrics=None):
    first = reference_metrics or next(iter(results.values()))[2]
    for cp, (_, _, metrics) in results.items():
        for stage in ("train", "val"):
            for key in METRIC_KEYS:
                name = f"{stage}/{key}" + ("_epoch" if stage == "train" else "")
                assert name in metrics, name
                assert metrics[name] == pytest.approx(first[name], rel=1e-5), f"cp={cp} {name}"


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_two_ranks_match_single_process(world2, packed):
    per_rank = world2.run(_run_layouts, (1, 2), packed)
    assert per_rank[0][1][0] == per_rank[1][1][0]  # CP peers log the same numbers
    _check_against_reference(per_rank[0], packed)
    _check_metrics_equal(per_rank[0])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_four_ranks_match_single_process(world4, packed):
    per_rank = world4.run(_run_layouts, (1, 2, 4), packed)
    _check_against_reference(per_rank[0], packed)
    _check_metrics_equal(per_rank[0])


@pytest.mark.parametrize(
    "cp, packed, accumulate", [(2, True, 2), (4, False, 4)], ids=["dp2-cp2-packed-x2", "dp1-cp4-padded-x4"]
)
def test_gradient_accumulation_normalizes_over_the_whole_step(world4, cp, packed, accumulate):
    """Micro-batches of one optimizer step: still the token mean over the global batch, also in a first step
    with one target, none in its first micro-batches (``_FirstTokenTargets``)."""
    per_rank = world4.run(_run_layouts, (cp,), packed, accumulate, one_target_first_step=True)
    losses, weights, _ = per_rank[0][cp]
    _, ref_weights = _reference(packed, one_target_first_step=True)
    assert len(losses) == STEPS
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)


class _LoggingModule(GPTModule):
    def training_step(self, batch, batch_idx):
        self.log("rank_mean", float(dist.get_rank()), sync_dist=True)
        return super().training_step(batch, batch_idx)


def _fit_epochs(dirpath, epochs, resume):
    world = dist.get_world_size()
    seed_everything(0)
    module = _LoggingModule(CONFIG, lr=LR)
    recorder = _Recorder()
    checkpoint = ModelCheckpoint(dirpath=dirpath, save_last=True, monitor="val/loss", mode="min")
    stopping = EarlyStopping(monitor="val/loss", patience=100, mode="min")
    trainer = _trainer(
        2, world, max_epochs=epochs, callbacks=[recorder, checkpoint, stopping], enable_checkpointing=True
    )
    micro_batch = GLOBAL_BATCH // (world // 2)
    train, val = (
        _loader(micro_batch, False, _dataset(2 * GLOBAL_BATCH)),
        _loader(micro_batch, False, _dataset(GLOBAL_BATCH, 9)),
    )
    trainer.fit(module, train, val, ckpt_path=os.path.join(dirpath, "last.ckpt") if resume else None)
    return {
        "losses": recorder.losses,
        "val_losses": recorder.val_losses,
        "rank_mean": trainer.callback_metrics["rank_mean"].item(),
        "wait": stopping.wait_count,
        "best_score": stopping.best_score.item(),
        "best_path": checkpoint.best_model_path,
        "best_model_score": checkpoint.best_model_score.item(),
    }


def test_resume_from_checkpoint_continues_with_the_same_losses(world4, tmp_path):
    straight = world4.run(_fit_epochs, str(tmp_path / "straight"), 3, False)[0]
    first = world4.run(_fit_epochs, str(tmp_path / "resumed"), 1, False)[0]
    resumed = world4.run(_fit_epochs, str(tmp_path / "resumed"), 3, True)[0]
    assert len(straight["losses"]) == 6 and len(first["losses"]) == 2 and len(resumed["losses"]) == 4
    assert first["losses"] + resumed["losses"] == pytest.approx(straight["losses"], rel=1e-6)
    assert straight["rank_mean"] == pytest.approx(1.5)  # self.log(sync_dist=True) averages over all 4 ranks
    # EarlyStopping and ModelCheckpoint state survive the resume: the best validation loss of all three
    # epochs, and the number of epochs since it, as in the uninterrupted run.
    val_losses = first["val_losses"] + resumed["val_losses"]
    assert val_losses == pytest.approx(straight["val_losses"], rel=1e-6)
    best_epoch = min(range(3), key=val_losses.__getitem__)
    for run in (straight, resumed):
        assert run["best_score"] == pytest.approx(min(val_losses), rel=1e-6)
        assert run["best_model_score"] == pytest.approx(min(val_losses), rel=1e-6)
        assert run["wait"] == 2 - best_epoch
    assert os.path.exists(resumed["best_path"])


def _bad_batches():
    seed_everything(0)
    messages = []
    for batch in (
        {"tokens": torch.zeros(2, 8, dtype=torch.long)},
        {"input_ids": torch.zeros(1, 8, dtype=torch.long), "cu_seqlens": torch.tensor([0, 5])},
    ):
        trainer = _trainer(2, dist.get_world_size(), max_steps=1)
        try:
            trainer.fit(GPTModule(CONFIG), DataLoader([batch], batch_size=None))
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_batches_are_clear_errors_on_every_rank(world2):
    for messages in world2.run(_bad_batches):
        assert len(messages) == 2
        assert "'input_ids'" in messages[0]
        assert "cu_seqlens" in messages[1] and "end at" in messages[1]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cp": 2.0}, TypeError, r"cp=2\.0"),
        ({"cp": "2"}, TypeError, "integer"),
        ({"cp": 0}, ValueError, ">= 1"),
        ({"tp": -1}, ValueError, ">= 1"),
    ],
)
def test_bad_sizes_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        MegatronCPStrategy(**kwargs)


def test_world_size_not_divisible_fails_when_the_trainer_is_built():
    with pytest.raises(
        ValueError, match=r"devices=3: world size 3 is not divisible by cp\(2\) \* tp\(1\) = 2"
    ):
        Trainer(accelerator="cpu", devices=3, strategy=MegatronCPStrategy(cp=2), logger=False)


def test_unknown_keywords_fail_at_construction():
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['find_unused_parameter'\]"):
        MegatronCPStrategy(cp=2, find_unused_parameter=True)
    with pytest.raises(ValueError, match="gives DDP the DP x CP group itself"):
        MegatronCPStrategy(process_group=object())
    assert MegatronCPStrategy(find_unused_parameters=True, ddp_comm_hook=None)._ddp_kwargs == {
        "find_unused_parameters": True
    }


def test_the_layout_is_not_available_before_setup():
    with pytest.raises(RuntimeError, match="before the processes have initialized"):
        _ = MegatronCPStrategy(cp=2).layout


def test_registered_by_name():
    trainer = Trainer(accelerator="cpu", devices=2, strategy="megatron_cp", logger=False)
    assert isinstance(trainer.strategy, MegatronCPStrategy) and trainer.strategy.cp == 1


class _Probe(Callback):
    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        self.info = {
            "ddp_group_size": dist.get_world_size(strategy.model.process_group),
            "layout": (strategy.layout.dp, strategy.layout.cp, strategy.layout.cp_rank),
            "current": current_layout() is strategy.layout,
            "sampler": strategy.distributed_sampler_kwargs,
        }


def _count_layout_work():
    """Fit 3 packed steps of a 2-layer GPT, counting the CP split's index work."""
    calls = {"build": 0, "positions": 0}
    build, positions = CPShard.build.__func__, CPSplit.positions

    def counted_build(cls, *args, **kwargs):
        calls["build"] += 1
        return build(cls, *args, **kwargs)

    def counted_positions(self, *args, **kwargs):
        calls["positions"] += 1
        return positions(self, *args, **kwargs)

    CPShard.build, CPSplit.positions = classmethod(counted_build), counted_positions
    try:
        seed_everything(0)
        probe = _Probe()
        trainer = _trainer(2, dist.get_world_size(), max_steps=3, callbacks=[probe])
        trainer.fit(GPTModule(CONFIG), _loader(2, True))
    finally:
        CPShard.build, CPSplit.positions = classmethod(build), positions
    return calls, probe.info, current_layout() == ParallelLayout.data_parallel()


def test_strategy_builds_ddp_over_dp_x_cp_and_splits_each_batch_once(world4):
    for rank, (calls, info, restored) in enumerate(world4.run(_count_layout_work)):
        # 3 training batches: one split and one layout each, whatever the number of layers.
        assert calls == {"build": 3, "positions": 3}
        assert info["ddp_group_size"] == 4  # DDP reduces over DP x CP = 2 x 2
        assert info["layout"] == (2, 2, rank % 2) and info["current"]
        assert info["sampler"] == {"num_replicas": 2, "rank": rank // 2}
        assert restored  # teardown hands the current layout back


class _Wrapper(Callback):
    def on_train_start(self, trainer, pl_module):
        self.wrapped = trainer.strategy.model is not pl_module


def _fit_one_replica():
    """tp = 2 on 2 ranks: a single replica (dp * cp == 1) of a GPT whose weights TP replicates."""
    seed_everything(0)
    module = GPTModule(CONFIG, lr=LR)
    recorder, wrapper = _Recorder(), _Wrapper()
    trainer = _trainer(
        1,
        dist.get_world_size(),
        strategy=MegatronCPStrategy(tp=2),
        max_steps=STEPS,
        callbacks=[recorder, wrapper],
    )
    trainer.fit(module, _loader(GLOBAL_BATCH, False))
    return recorder.losses, module.model.state_dict(), wrapper.wrapped


def test_a_single_replica_is_trained_unwrapped_and_matches_single_process(world2):
    # layout.loss_group is None: no other replica to average with, so no DDP (and no group of one rank).
    ref_losses, ref_weights = _reference(False)
    for losses, weights, wrapped in world2.run(_fit_one_replica):
        assert not wrapped
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for name, value in ref_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)


class _Weights(Callback):
    def on_validation_start(self, trainer, pl_module):
        self.weights = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}


def _validate_with_tp_shards():
    """tp = 2 on 2 ranks: before ``validate``, one weight marked as this rank's TP shard and one replicated
    weight hold the rank's number; returns both as the evaluation sees them."""
    module = GPTModule(CONFIG)
    shard, replicated = module.model.norm.weight, module.model.embed.weight
    shard.tensor_model_parallel = True
    with torch.no_grad():
        shard.fill_(dist.get_rank())
        replicated.fill_(dist.get_rank())
    weights = _Weights()
    trainer = _trainer(1, dist.get_world_size(), strategy=MegatronCPStrategy(tp=2), callbacks=[weights])
    trainer.validate(module, _loader(GLOBAL_BATCH, False))
    return weights.weights["norm.weight"].unique().tolist(), weights.weights["embed.weight"].unique().tolist()


def test_evaluation_keeps_each_rank_s_tensor_parallel_shard(world2):
    """Lightning's DDP setup broadcasts rank 0's module over the whole world to evaluate: here TP shards stay
    each rank's, and replicated weights come from TP rank 0 (as when fitting)."""
    for rank, (shard, replicated) in enumerate(world2.run(_validate_with_tp_shards)):
        assert shard == [float(rank)] and replicated == [0.0]


# --- gradient clipping over tensor-parallel shards -----------------------------------------------------------

TP_VOCAB, TP_HIDDEN, TP_CLIP = 24, 8, 0.05


def _tp_rows():
    """8 rows: two global batches of 4 (2 per DP rank at dp 2)."""
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": ids} for ids in torch.randint(0, TP_VOCAB, (8, 14), generator=g)]


class _VocabParallelHead(CPLossMixin, LightningModule):
    """An embedding replicated on every TP rank and an output head split over the vocabulary (a TP shard), as
    Megatron marks it; SGD, so the clipped gradient is the update."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(TP_VOCAB, TP_HIDDEN, generator=g))
        self.full_head = torch.randn(TP_VOCAB, TP_HIDDEN, generator=g)

    def configure_model(self):
        layout = self.trainer.strategy.layout
        self.head = torch.nn.Parameter(self.full_head.chunk(layout.tp)[layout.tp_rank].clone())
        self.head.tensor_model_parallel = True

    def training_step(self, batch, batch_idx):
        return self.lm_loss(self.embed[batch["input_ids"]], self.head, batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def _fit_tp_clipped():
    """tp 2 x dp 2 (no attention here, so no CP: the clipping does not depend on it)."""
    trainer = _trainer(1, strategy=MegatronCPStrategy(tp=2), max_steps=2, gradient_clip_val=TP_CLIP)
    module = _VocabParallelHead()
    trainer.fit(module, DataLoader(_tp_rows(), batch_size=2, collate_fn=collate_padded))
    return dist.get_rank() % 2, module.embed.detach(), module.head.detach()  # TP ranks are adjacent


def _reference_tp_clipped():
    """The plain loop: the whole head, the token mean, torch's clip_grad_norm_ over both, SGD."""
    module = _VocabParallelHead()
    embed, head = module.embed, torch.nn.Parameter(module.full_head.clone())
    rows = _tp_rows()  # in the order of Lightning's shuffling sampler (seed 0), whatever the DP size
    loader = DataLoader(rows, batch_size=4, sampler=DistributedSampler(rows, num_replicas=1, rank=0, seed=0))
    for batch in loader:
        ids = batch["input_ids"]
        logits = embed[ids[:, :-1]] @ head.T
        loss = F.cross_entropy(logits.reshape(-1, TP_VOCAB), ids[:, 1:].reshape(-1))
        embed.grad = head.grad = None
        loss.backward()
        assert torch.nn.utils.clip_grad_norm_([embed, head], TP_CLIP) > 2 * TP_CLIP  # clipping matters
        with torch.no_grad():
            embed -= embed.grad
            head -= head.grad
    return embed.detach(), head.detach()


def test_gradient_clipping_counts_every_tensor_parallel_shard_once(world4):
    """Lightning's clip_grad_norm_ sees one TP rank's head shard: each rank clipped by another, too small norm
    and the TP replicas of the embedding drifted apart."""
    embed, head = _reference_tp_clipped()
    for tp_rank, got_embed, got_head in world4.run(_fit_tp_clipped):
        torch.testing.assert_close(got_embed, embed, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_head, head.chunk(2)[tp_rank], rtol=1e-5, atol=1e-6)
