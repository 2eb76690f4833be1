"""CPLossMixin's normalization: sharded losses give the gradient of the unsharded token mean."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule

from lightning_cp import CPLossMixin
from lightning_cp.loss.mixin import _head_inputs
from lightning_cp.ops import OutputHead
from lightning_cp.parallel import groups, shard_batch
from lightning_cp.parallel.layout import set_current_layout

VOCAB, HIDDEN, ROWS, SEQ = 24, 8, 4, 14


class _Head(CPLossMixin, LightningModule):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.head = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g) * 0.3)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    # Very unequal masks: row 0 has one target, row 3 all; every CP rank holds a different count.
    mask = torch.rand(ROWS, SEQ, generator=g) < torch.tensor([0.1, 0.4, 0.7, 1.0])[:, None]
    return {"input_ids": ids, "loss_mask": mask.float()}


# Every option of the fused loss at once, with values large enough to move the loss by far more than 1%.
LOSS_OPTIONS = {"label_smoothing": 0.2, "z_loss": 0.05, "softcap": 2.0}


def _one_target_step():
    """The micro-batches of an optimizer step with one target in all: none in the first, one (row 2, token 9)
    in the second. Every rank but one holds none, and the first micro-batch's global count is 0 (Megatron-LM
    #7513: a CP-local mean would give this token a 1 / |DP x CP| share of its gradient)."""
    mask = torch.zeros(ROWS, SEQ)
    mask[2, 9] = 1.0
    return [{**_batch(), "loss_mask": torch.zeros(ROWS, SEQ)}, {**_batch(), "loss_mask": mask}]


def _reference_grads(micro_batches=None, **options):
    """The token mean over the whole batch (every micro-batch's rows; ``_batch()`` alone by default), on
    materialized logits, with the options written out by hand."""
    module = _Head()
    micro_batches = micro_batches or [_batch()]
    batch = {k: torch.cat([m[k] for m in micro_batches]) for k in micro_batches[0]}
    labels = batch["input_ids"].roll(-1, 1)
    target = batch["loss_mask"].roll(-1, 1).bool()
    target[:, -1] = False
    logits = (module.embed[batch["input_ids"]] @ module.head.T)[target]
    if "softcap" in options:
        logits = options["softcap"] * torch.tanh(logits / options["softcap"])
    loss = F.cross_entropy(logits, labels[target], label_smoothing=options.get("label_smoothing", 0.0))
    loss = loss + options.get("z_loss", 0.0) * torch.logsumexp(logits, -1).square().mean()
    loss.backward()
    return loss.detach(), module.embed.grad, module.head.grad


def _sharded_grads(cp, from_logits, micro_batches=None, sharding="ddp", **options):
    """The mixin's loss on this rank's shard of this DP rank's rows of each micro-batch (``_batch()`` alone by
    default), as Lightning accumulates them (each loss divided by their number, the mixin's rescale before the
    optimizer step); the gradients averaged over DP x CP as DDP does, or the head's as FSDP does (a
    ``DTensor`` sharded over the ranks, its gradient reduce-scattered by the loss)."""
    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    module = _Head()
    head = module.head
    if sharding == "fsdp":
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        head = torch.nn.Parameter(distribute_tensor(module.head.detach(), mesh, [Shard(0)]))
    micro_batches = micro_batches or [_batch()]
    rows = slice(layout.dp_rank * ROWS // layout.dp, (layout.dp_rank + 1) * ROWS // layout.dp)
    for full in micro_batches:
        batch = shard_batch({k: v[rows] for k, v in full.items()}, cp, layout.cp_rank)
        hidden = module.embed[batch["input_ids"]]
        if from_logits:
            loss = module.lm_loss_from_logits(hidden @ module.head.T, batch, **options)
        else:
            loss = module.lm_loss(hidden, head, batch, **options)
        (loss / len(micro_batches)).backward()
    module._cp_objective.rescale_gradients([module.embed, head], len(micro_batches))
    # A DTensor head's gradient is already averaged over the mesh by the loss's reduce-scatter.
    for grad in [module.embed.grad] + ([head.grad] if sharding == "ddp" else []):
        dist.all_reduce(grad, group=layout.loss_group)
        grad /= layout.dp * layout.cp
    return module.embed.grad, head.grad.full_tensor() if sharding == "fsdp" else head.grad


@pytest.mark.parametrize("from_logits", [False, True], ids=["lm_loss", "lm_loss_from_logits"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_sharded_mixin_loss_has_the_gradient_of_the_global_token_mean(world4, cp, from_logits):
    _, ref_embed, ref_head = _reference_grads()
    for embed_grad, head_grad in world4.run(_sharded_grads, cp, from_logits):
        torch.testing.assert_close(embed_grad, ref_embed, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(head_grad, ref_head, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("from_logits", [False, True], ids=["lm_loss", "lm_loss_from_logits"])
def test_loss_options_reach_the_fused_loss(world4, from_logits):
    ref_loss, ref_embed, ref_head = _reference_grads(**LOSS_OPTIONS)
    plain_loss, _, _ = _reference_grads()
    assert abs(ref_loss - plain_loss) > 0.05 * plain_loss  # the options matter at this size
    for embed_grad, head_grad in world4.run(_sharded_grads, 2, from_logits, **LOSS_OPTIONS):
        torch.testing.assert_close(embed_grad, ref_embed, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(head_grad, ref_head, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "cp, sharding",
    [(1, "ddp"), (2, "ddp"), (4, "ddp"), (2, "fsdp")],
    ids=["dp4", "dp2-cp2", "cp4", "fsdp-dp2-cp2"],
)
def test_one_target_in_an_accumulated_step_gets_its_whole_gradient(world4, cp, sharding):
    """Ranks and a whole first micro-batch without any target: the step's gradient is still that token's."""
    micro_batches = _one_target_step()
    _, ref_embed, ref_head = _reference_grads(micro_batches)
    assert ref_head.abs().max() > 0.1
    for embed_grad, head_grad in world4.run(_sharded_grads, cp, False, micro_batches, sharding):
        torch.testing.assert_close(embed_grad, ref_embed, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(head_grad, ref_head, rtol=1e-5, atol=1e-6)


def _evaluation_losses():
    """The value the mixin returns outside training (no trainer, no grad): for every layout."""
    out = {}
    for cp in (1, 2, 4):
        layout = groups.initialize(tp=1, cp=cp)
        set_current_layout(layout)
        module = _Head()
        rows = slice(layout.dp_rank * ROWS // layout.dp, (layout.dp_rank + 1) * ROWS // layout.dp)
        batch = shard_batch({k: v[rows] for k, v in _batch().items()}, cp, layout.cp_rank)
        with torch.no_grad():
            out[cp] = module.lm_loss(module.embed[batch["input_ids"]], module.head, batch).item()
        set_current_layout(None)
        groups.destroy()
    return out


def test_evaluation_returns_the_global_token_mean_on_every_rank(world4):
    ref_loss, _, _ = _reference_grads()
    for losses in world4.run(_evaluation_losses):
        for cp, loss in losses.items():
            assert loss == pytest.approx(ref_loss.item(), rel=1e-6), f"cp={cp}"


def _tensor_parallel_grads(vocab_parallel, from_logits):
    """tp=2 x cp=2: the head either split over the vocabulary (marked as Megatron marks it) or replicated;
    ``from_logits``: the loss of this rank's ``[B, S_local, V / tp]`` logits of the split head."""
    layout = groups.initialize(tp=2, cp=2)
    set_current_layout(layout)
    module = _Head()
    head = module.head
    if vocab_parallel:
        rows = VOCAB // 2
        head = torch.nn.Parameter(
            module.head.detach()[layout.tp_rank * rows : (layout.tp_rank + 1) * rows].clone()
        )
        head.tensor_model_parallel = True
    batch = shard_batch(_batch(), 2, layout.cp_rank)
    hidden = module.embed[batch["input_ids"]]
    if from_logits:
        loss = module.lm_loss_from_logits(hidden @ head.T, batch, vocab_parallel=True)
    else:
        loss = module.lm_loss(hidden, head, batch)
    loss.backward()
    if from_logits:  # a column-parallel head's backward sums its input's gradient over TP, as Megatron's does
        dist.all_reduce(module.embed.grad, group=layout.tp_group)
    for param in (module.embed, head):
        dist.all_reduce(param.grad, group=layout.loss_group)
        param.grad /= layout.dp * layout.cp
    return layout.tp_rank, module.embed.grad, head.grad


@pytest.mark.parametrize(
    "vocab_parallel, from_logits",
    [(False, False), (True, False), (True, True)],
    ids=["replicated_head", "vocab_parallel_head", "vocab_parallel_logits"],
)
def test_tensor_parallel_head_gives_the_same_gradients(world4, vocab_parallel, from_logits):
    _, ref_embed, ref_head = _reference_grads()
    for tp_rank, embed_grad, head_grad in world4.run(_tensor_parallel_grads, vocab_parallel, from_logits):
        torch.testing.assert_close(embed_grad, ref_embed, rtol=1e-5, atol=1e-6)
        expected = ref_head.chunk(2)[tp_rank] if vocab_parallel else ref_head
        torch.testing.assert_close(head_grad, expected, rtol=1e-5, atol=1e-6)


def test_a_cp_local_mean_would_be_wrong():
    """Guard for the test above: the per-rank mean of local means differs from the token mean here."""
    batch = _batch()
    shards = [shard_batch(batch, 4, r) for r in range(4)]
    counts = [s["loss_mask"].sum().item() for s in shards]
    assert len(set(counts)) > 1


# The head's transforms, each large enough to move the loss by far more than 1% (Phi's bias, Cohere's
# logit_scale, Gemma-2's final softcap).
HEAD_TRANSFORMS = {"logit_scale": 0.4, "softcap": 3.0}


def _bias():
    return torch.nn.Parameter(torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)))


def _reference_head_grads():
    """The token mean of ``softcap(logit_scale * (hidden @ head.T + bias))``, written out by hand."""
    module, bias = _Head(), _bias()
    batch = _batch()
    labels = batch["input_ids"].roll(-1, 1)
    target = batch["loss_mask"].roll(-1, 1).bool()
    target[:, -1] = False
    logits = (module.embed[batch["input_ids"]] @ module.head.T + bias)[target] * HEAD_TRANSFORMS[
        "logit_scale"
    ]
    logits = HEAD_TRANSFORMS["softcap"] * torch.tanh(logits / HEAD_TRANSFORMS["softcap"])
    loss = F.cross_entropy(logits, labels[target])
    loss.backward()
    return loss.detach(), module.embed.grad, module.head.grad, bias.grad


def _output_head_grads(cp, sharding):
    """The mixin's loss through an OutputHead on this rank's shard; the gradients averaged as DDP / FSDP do."""
    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    module, bias = _Head(), _bias()
    weight = module.head
    rows = slice(layout.dp_rank * ROWS // layout.dp, (layout.dp_rank + 1) * ROWS // layout.dp)
    batch = shard_batch({k: v[rows] for k, v in _batch().items()}, cp, layout.cp_rank)
    if sharding == "fsdp":
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        weight = torch.nn.Parameter(distribute_tensor(module.head.detach(), mesh, [Shard(0)]))
        bias = torch.nn.Parameter(distribute_tensor(bias.detach(), mesh, [Shard(0)]))
    head = OutputHead(weight, bias, **HEAD_TRANSFORMS)
    module.lm_loss(module.embed[batch["input_ids"]], head, batch).backward()
    grads = [module.embed.grad]
    if sharding == "fsdp":  # already averaged over the mesh by the loss's reduce-scatter
        grads += [weight.grad.full_tensor(), bias.grad.full_tensor()]
    else:
        grads += [weight.grad, bias.grad]
    for i, grad in enumerate(grads):
        if i == 0 or sharding != "fsdp":
            dist.all_reduce(grad, group=layout.loss_group)
            grad /= layout.dp * layout.cp
    return grads


@pytest.mark.parametrize("cp, sharding", [(1, "ddp"), (2, "ddp"), (4, "ddp"), (2, "fsdp")])
def test_an_output_head_trains_its_bias_scale_and_softcap(world4, cp, sharding):
    ref_loss, *expected = _reference_head_grads()
    plain_loss, _, _ = _reference_grads()
    assert abs(ref_loss - plain_loss) > 0.05 * plain_loss  # the transforms matter at this size
    for grads in world4.run(_output_head_grads, cp, sharding):
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _head_inputs_from_host_shards():
    """The fused loss's head inputs from an FSDP head whose shards are in host memory (``cpu_offload``) and
    hidden states on another device (``meta``: a stand-in for CUDA): the devices of the weight and bias."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    layout = groups.initialize(tp=1, cp=1)
    mesh = init_device_mesh("cpu", (1,))
    weight, bias = (
        torch.nn.Parameter(distribute_tensor(t.detach(), mesh, [Shard(0)])) for t in (_Head().head, _bias())
    )
    hidden = torch.empty(ROWS, SEQ, HIDDEN, device="meta")
    labels = {"labels": torch.zeros(ROWS, SEQ, dtype=torch.long)}
    _, weight, _, kwargs = _head_inputs(hidden, OutputHead(weight, bias), labels, layout, {})
    return weight.device.type, kwargs["bias"].device.type


def test_a_head_sharded_in_host_memory_is_gathered_on_the_device_of_the_hidden_states(world1):
    """Gathered there, its gradient reduce-scattered there (NCCL on CUDA), and copied back to the host."""
    assert world1.run(_head_inputs_from_host_shards) == [("meta", "meta")]


def _vocab_parallel_output_head_grads():
    layout = groups.initialize(tp=2, cp=2)
    set_current_layout(layout)
    module, bias = _Head(), _bias()
    rows = slice(layout.tp_rank * VOCAB // 2, (layout.tp_rank + 1) * VOCAB // 2)
    weight = torch.nn.Parameter(module.head.detach()[rows].clone())
    bias = torch.nn.Parameter(bias.detach()[rows].clone())
    weight.tensor_model_parallel = bias.tensor_model_parallel = True
    batch = shard_batch(_batch(), 2, layout.cp_rank)
    module.lm_loss(
        module.embed[batch["input_ids"]], OutputHead(weight, bias, **HEAD_TRANSFORMS), batch
    ).backward()
    for param in (module.embed, weight, bias):
        dist.all_reduce(param.grad, group=layout.loss_group)
        param.grad /= layout.dp * layout.cp
    return layout.tp_rank, module.embed.grad, weight.grad, bias.grad


def test_a_vocab_parallel_output_head_shards_its_bias_like_its_weight(world4):
    _, ref_embed, ref_head, ref_bias = _reference_head_grads()
    for tp_rank, embed_grad, head_grad, bias_grad in world4.run(_vocab_parallel_output_head_grads):
        torch.testing.assert_close(embed_grad, ref_embed, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(head_grad, ref_head.chunk(2)[tp_rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bias_grad, ref_bias.chunk(2)[tp_rank], rtol=1e-5, atol=1e-6)


def test_lm_token_logprobs_apply_the_output_head():
    module, bias = _Head(), _bias()
    batch = shard_batch(_batch(), 1, 0)
    hidden = module.embed[batch["input_ids"]].detach()
    out = module.lm_token_logprobs(hidden, OutputHead(module.head, bias, **HEAD_TRANSFORMS), batch)
    logits = HEAD_TRANSFORMS["softcap"] * torch.tanh(
        HEAD_TRANSFORMS["logit_scale"] * (hidden @ module.head.T + bias) / HEAD_TRANSFORMS["softcap"]
    )
    target = batch["labels"] != -100
    expected = logits.log_softmax(-1).gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
    torch.testing.assert_close(out["logprobs"][target], expected[target].detach(), rtol=1e-5, atol=1e-6)


def test_a_marked_bare_weight_and_doubled_transforms_are_refused():
    module, bias = _Head(), _bias()
    batch = shard_batch(_batch(), 1, 0)
    hidden = module.embed[batch["input_ids"]]
    head = OutputHead(module.head, bias, logit_scale=0.4)
    with pytest.raises(ValueError, match="softcap given both to lm_loss and on the OutputHead"):
        module.lm_loss(hidden, head, batch, softcap=2.0)
    head.mark_weight("CohereForCausalLM")
    with pytest.raises(ValueError, match=r"CohereForCausalLM \(its logits apply bias, logit_scale=0.4\)"):
        module.lm_loss(hidden, module.head, batch)
    OutputHead(module.head).mark_weight("LlamaForCausalLM")  # a plain head clears the mark
    module.lm_loss(hidden, module.head, batch)
