"""MegatronCPFSDPStrategy: FSDP2 over DP x CP trains exactly as a plain single-process loop.

The reference is ``test_megatron_cp``'s hand-written loop (``F.cross_entropy`` on materialized logits, the
token mean over the global batch, the same AdamW); under bf16-mixed, its first step computed in bf16. Each
case runs on a shared pool of gloo ranks (4, or 1 and 2 for the smaller layouts). With ``cpu_offload`` the
compute device is the host here, so the cases show that the offloaded units train the same (FSDP's own
offload paths: the gradient shards accumulated, clipped and stepped by the host); where the tensors live on
CUDA is the ``gpu`` test's.
"""

import inspect
import math
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard
from torchmetrics import MeanMetric

from lightning_cp import MegatronCPFSDPStrategy, MegatronCPStrategy
from lightning_cp.models import GPTModule
from lightning_cp.strategies import _fsdp, consolidate_checkpoint, default_layer_classes
from lightning_cp.strategies._fsdp import mixed_precision_policy
from tests._trainer import cp_trainer as _trainer
from tests._trainer import quiet_trainer
from tests.strategies.test_megatron_cp import (
    CONFIG,
    GLOBAL_BATCH,
    LR,
    STEPS,
    _dataset,
    _loader,
    _Recorder,
    _reference,
)


class _Probe(Callback):
    """What the strategy built: the mesh, each parameter's shard and dtypes, the residual stream's dtypes."""

    def on_train_start(self, trainer, pl_module):
        mesh = trainer.strategy.device_mesh
        self.mesh = (mesh.mesh_dim_names, tuple(mesh.shape), tuple(mesh.get_coordinate()))
        self.shards = (
            {}
            if not isinstance(trainer.strategy, MegatronCPFSDPStrategy)
            else {
                name: (param.to_local().numel(), param.numel(), param.device_mesh.size(), param.placements)
                for name, param in pl_module.model.named_parameters()
            }
        )
        self.forward_dtype = None
        trainer.strategy.model.module.model.blocks[0].mlp.register_forward_pre_hook(self._record_dtype)
        # The dtypes of the hidden states into each block and out of the last.
        blocks = pl_module.model.blocks
        self.residual_dtypes = [None] * (len(blocks) + 1)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(partial(self._record_residual, i))
        blocks[-1].register_forward_hook(partial(self._record_residual, -1))
        self.state = set()

    def _record_dtype(self, module, args):
        self.forward_dtype = module[0].weight.dtype

    def _record_residual(self, index, module, args, output=None):
        self.residual_dtypes[index] = (args[0] if output is None else output).dtype

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        param = pl_module.model.blocks[0].mlp[0].weight
        self.dtypes = (param.dtype, param.grad.dtype, self.forward_dtype)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        """Between steps: each unit's offload policy, where the model state's tensors are (``(kind, device
        type, pinned)`` over every step) and the device the module reports."""
        self.policies = {
            name: (type(policy).__name__, getattr(policy, "pin_memory", None))
            for name, policy in _offload_policies(trainer.strategy.model).items()
        }
        found = _model_state(pl_module, trainer.optimizers[0])
        self.state |= {(kind, tensor.device.type, tensor.is_pinned()) for kind, _, tensor in found}
        self.module_device = pl_module.device.type

    def on_train_end(self, trainer, pl_module):
        self.weights = _full_weights(pl_module)
        state = trainer.optimizers[0].state
        self.moments = {
            name.removeprefix("model."): tuple(
                state[param][key].full_tensor() for key in ("exp_avg", "exp_avg_sq")
            )
            for name, param in pl_module.named_parameters()
        }


def _offload_policies(root):
    """Each FSDP unit's offload policy (the root's under the name ``""``), by module name."""
    # FSDP2 has no public accessor of a unit's policy: its parameter group's is the one its copies follow.
    return {
        name: module._get_fsdp_state()._fsdp_param_group.offload_policy
        for name, module in root.named_modules()
        if isinstance(module, FSDPModule)
    }


_STATE_KINDS = ("parameter", "gradient", "exp_avg", "exp_avg_sq", "step")


def _model_state(pl_module, optimizer):
    """This rank's part of the model state: ``(kind, parameter name, local tensor)`` for every parameter
    shard, gradient shard and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``)."""
    found = []
    for name, param in pl_module.named_parameters():
        found.append(("parameter", name, param.to_local()))
        if param.grad is not None:
            found.append(("gradient", name, param.grad.to_local()))
        for key, value in optimizer.state[param].items():
            found.append((key, name, value.to_local() if isinstance(value, DTensor) else value))
    return found


def _full_weights(pl_module):
    """The gathered weights, while the mesh's groups exist (every rank takes part in the all-gathers)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in pl_module.model.state_dict().items()
    }


def _fit(
    cp,
    packed,
    accumulate=1,
    clip=None,
    precision="32-true",
    steps=STEPS,
    one_target_first_step=False,
    **strategy_kwargs,
):
    dp = dist.get_world_size() // cp
    seed_everything(0)
    module = GPTModule(CONFIG, lr=LR)
    recorder, probe = _Recorder(), _Probe()
    trainer = _trainer(
        cp,
        dist.get_world_size(),
        strategy=MegatronCPFSDPStrategy(cp=cp, **strategy_kwargs),
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        precision=precision,
        callbacks=[recorder, probe],
    )
    data = _dataset(one_target_first_step=one_target_first_step)
    trainer.fit(module, _loader(GLOBAL_BATCH // dp // accumulate, packed, data))
    return {
        "losses": recorder.losses,
        "weights": probe.weights,
        "mesh": probe.mesh,
        "shards": probe.shards,
        "dtypes": probe.dtypes,
        "residual_dtypes": tuple(probe.residual_dtypes),
        "moments": probe.moments,
        "policies": probe.policies,
        "state": probe.state,
    }


# Each feature at least once, without the full product: layouts (dp, cp) = (2, 2), (1, 4), (4, 1);
# padded and packed; gradient accumulation (its first step with one target, none in its first micro-batch);
# clipping; the embedding (the tied head) as its own unit, resharded before the loss, so the loss gathers a
# DTensor head; activation checkpointing. With the model
# state on the host (cpu_offload), at (1, 1) (a world of one: one GPU), (1, 2) and (2, 2): padded and packed,
# with accumulation (the host adds the gradient shards), and clipping over a sharded head.
_CASES = {
    "dp2-cp2-padded": (4, {"cp": 2, "packed": False}),
    "dp1-cp4-packed-accumulate": (
        4,
        {
            "cp": 4,
            "packed": True,
            "accumulate": 2,
            "one_target_first_step": True,
            "activation_checkpointing": ["_Block"],
        },
    ),
    "dp4-cp1-packed-clip-sharded-head": (
        4,
        {"cp": 1, "packed": True, "clip": 0.05, "fsdp_wrap": ["_Block", "Embedding"]},
    ),
    "offload-dp1-cp1-packed": (1, {"cp": 1, "packed": True, "cpu_offload": True}),
    "offload-dp1-cp2-padded-accumulate": (
        2,
        {"cp": 2, "packed": False, "accumulate": 2, "one_target_first_step": True, "cpu_offload": True},
    ),
    "offload-dp2-cp2-packed-clip-sharded-head": (
        4,
        {"cp": 2, "packed": True, "clip": 0.05, "fsdp_wrap": ["_Block", "Embedding"], "cpu_offload": True},
    ),
}


@pytest.mark.parametrize("case", list(_CASES), ids=list(_CASES))
def test_fsdp_matches_single_process(case, request):
    world, options = _CASES[case]
    per_rank = request.getfixturevalue(f"world{world}").run(_fit, **options)
    moments = {}
    ref_losses, ref_weights = _reference(
        options["packed"],
        clip=options.get("clip"),
        moments=moments,
        one_target_first_step=options.get("one_target_first_step", False),
    )
    result = per_rank[0]
    assert len(result["losses"]) == STEPS
    if options.get("accumulate", 1) == 1:  # with accumulation the logged value is the last micro-batch's
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
        )
    # Adam divides by sqrt(v): rounding differences of near-zero gradients (accumulated, then clipped) show
    # up as ~1.5e-5 in a few weights, the same with DDP; a 1% error in an update (~LR = 1e-2) is ~1e-4.
    for name, value in ref_weights.items():
        torch.testing.assert_close(result["weights"][name], value, rtol=1e-4, atol=3e-5, msg=name)
    # AdamW's moments: a 1% error in the gradients of any step is off by more than 1e-3 of the largest.
    for name, values in moments.items():
        for got, value in zip(result["moments"][name], values, strict=True):
            atol = 1e-4 * value.abs().max().item()
            torch.testing.assert_close(got, value, rtol=1e-4, atol=atol, msg=name)
    if options.get("clip") is not None:  # clipping must change the run, or the comparison says little
        unclipped = _reference(options["packed"])[0]
        assert abs(unclipped[-1] - ref_losses[-1]) > 1e-3 * abs(ref_losses[-1])
    assert set(result["residual_dtypes"]) == {torch.float32}  # the hidden states too
    # Every unit, the root ("") and the embedding when it is one, carries the same offload policy (unpinned:
    # the host is the compute device here); the model state is in host memory between steps.
    units = {"", "module.model.blocks.0", "module.model.blocks.1"}
    units |= {"module.model.embed"} if "Embedding" in options.get("fsdp_wrap", ()) else set()
    policy = ("CPUOffloadPolicy", False) if options.get("cpu_offload") else ("OffloadPolicy", None)
    assert result["policies"] == dict.fromkeys(units, policy)
    assert result["state"] == {(kind, "cpu", False) for kind in _STATE_KINDS}
    cp = options["cp"]
    for rank, rank_result in enumerate(per_rank):
        assert rank_result["mesh"] == (("dp", "cp", "tp"), (world // cp, cp, 1), (rank // cp, rank % cp, 0))
        assert rank_result["losses"] == result["losses"]


def test_every_parameter_is_sharded_over_dp_x_cp(world4):
    per_rank = world4.run(_fit, cp=2, packed=False, steps=1)
    for name, (_, numel, mesh_size, placements) in per_rank[0]["shards"].items():
        assert mesh_size == 4 and placements == (Shard(0),), name
        local = [rank_result["shards"][name][0] for rank_result in per_rank]
        assert sum(local) == numel, name
        rows = per_rank[0]["weights"][name].shape[0]
        assert max(local) <= math.ceil(rows / 4) * (numel // rows), name  # ~1/(dp*cp) of each unit


def test_mixed_precision_follows_the_trainer_precision(world4):
    assert mixed_precision_policy("bf16-mixed") == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    )
    assert mixed_precision_policy("32-true") == MixedPrecisionPolicy()
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*bf16-mixed"):
        mixed_precision_policy("16-mixed")
    # bf16-mixed: test_bf16_mixed_matches_a_single_process_loop_in_bf16.
    true = world4.run(_fit, cp=2, packed=False, steps=1, precision="bf16-true")[0]
    assert true["dtypes"] == (torch.bfloat16, torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize(("cp", "packed"), [(2, False), (4, True)], ids=["dp2-cp2-padded", "dp1-cp4-packed"])
def test_bf16_mixed_matches_a_single_process_loop_in_bf16(world4, cp, packed):
    result = world4.run(_fit, cp=cp, packed=packed, steps=1, precision="bf16-mixed")[0]
    # fp32 master weights and gradients (reduce-scattered in fp32), bf16 weights in the forward; so the
    # hidden states into every block and out of the last are bf16 (from the embedding's bf16 weight on).
    assert result["dtypes"] == (torch.float32, torch.float32, torch.bfloat16)
    assert set(result["residual_dtypes"]) == {torch.bfloat16}
    grads = {}
    losses, weights = _reference(packed, steps=1, compute_dtype=torch.bfloat16, gradients=grads)
    loss = losses[0]
    # Measured: 1.5e-5 relative (6e-5) on both layouts, bf16 rounding in another order (the reference in fp32
    # is as close: bf16 rounds the ~0.1 logits at initialization by at most ~2.5e-4). 1e-4 leaves room for
    # that and is 1/100 of a 1% error.
    assert result["losses"][0] == pytest.approx(loss, rel=1e-4)
    # AdamW's first step moves a weight by LR * sign(gradient), whatever the gradient's scale: bf16 flips the
    # sign of gradients below ~1% of their tensor's largest (measured), so only the weights whose gradient is
    # above 5% of it are compared (64% of all; 1/4 of the qkv weights). There the update is exact to fp32
    # rounding (measured <= 1.2e-7); one applied to bf16 weights, or 1% too large, is off by up to 1e-4.
    for name, value in weights.items():
        large = grads[name].abs() > 0.05 * grads[name].abs().max()
        torch.testing.assert_close(result["weights"][name][large], value[large], rtol=0, atol=1e-6, msg=name)


class _EpochWeights(Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.weights = _full_weights(pl_module)


def _fit_epochs(cp, dirpath, epochs, resume_from=None, cpu_offload=False):
    """Epochs of 2 packed steps, a sharded checkpoint after each (resuming mid-epoch would change the data)."""
    dp = dist.get_world_size() // cp
    seed_everything(0)
    module = GPTModule(CONFIG, lr=LR)
    recorder, weights = _Recorder(), _EpochWeights()
    trainer = _trainer(
        cp,
        dist.get_world_size(),
        strategy=MegatronCPFSDPStrategy(cp=cp, cpu_offload=cpu_offload),
        max_epochs=epochs,
        callbacks=[recorder, weights, ModelCheckpoint(dirpath=dirpath, save_top_k=-1)],
        enable_checkpointing=True,
    )
    data = _dataset(2 * GLOBAL_BATCH)
    trainer.fit(module, _loader(GLOBAL_BATCH // dp, True, data), ckpt_path=resume_from)
    return recorder.losses, getattr(weights, "weights", None)


def test_resume_from_a_sharded_checkpoint_continues_with_the_same_losses(world4, tmp_path):
    """A chain of resumes: a run's epoch 0, resumed with the model state on the host (cpu_offload), whose
    epoch 1 is resumed without it on another layout; each continues the uninterrupted run."""
    straight, epoch0_weights = world4.run(_fit_epochs, 2, str(tmp_path / "straight"), 3)[0]
    saved = tmp_path / "straight" / "epoch=0-step=2.ckpt"
    assert saved.is_dir() and len(list(saved.glob("*.distcp"))) == 4  # each rank wrote its own shard
    assert len(straight) == 6
    same = world4.run(_fit_epochs, 2, str(tmp_path / "same"), 3, str(saved), True)[0][0]
    assert same == pytest.approx(straight[2:], rel=1e-6)
    # Another layout (dp=1 x cp=4) reads the dp=2 x cp=2 shards the offloaded run wrote: DCP reshards them.
    offloaded = tmp_path / "same" / "epoch=1-step=4.ckpt"
    other = world4.run(_fit_epochs, 4, str(tmp_path / "other"), 3, str(offloaded))[0][0]
    assert other == pytest.approx(straight[4:], rel=1e-5)

    consolidate_checkpoint(saved, tmp_path / "epoch0.pt")
    loaded = GPTModule.load_from_checkpoint(tmp_path / "epoch0.pt", weights_only=False)
    for name, value in epoch0_weights.items():
        torch.testing.assert_close(loaded.model.state_dict()[name], value, rtol=0, atol=0, msg=name)


def _fit_with_bad_wrap():
    seed_everything(0)
    trainer = _trainer(2, dist.get_world_size(), strategy=MegatronCPFSDPStrategy(cp=2, fsdp_wrap=["Block"]))
    try:
        trainer.fit(GPTModule(CONFIG), _loader(2, False))
    except ValueError as error:
        return str(error)
    return None


def test_a_wrap_name_matching_no_module_is_a_clear_error_at_setup(world4):
    for message in world4.run(_fit_with_bad_wrap):
        assert "fsdp_wrap=...): 'Block' matches no module of GPTModule" in message
        assert "_Block" in message and "Embedding" in message  # the classes that are there


def _root_calls_at_setup():
    """How often the setup ran a function as the FSDP root's forward (the HF probe's route), for the GPT."""
    calls, original = [], _fsdp.call_in_root
    _fsdp.call_in_root = lambda root, function: calls.append(function) or original(root, function)
    try:
        _trainer(2, dist.get_world_size(), strategy=MegatronCPFSDPStrategy(cp=2), max_steps=1).fit(
            GPTModule(CONFIG), _loader(2, False)
        )
    finally:
        _fsdp.call_in_root = original
    return len(calls)


def test_a_module_without_transformers_models_is_not_probed_through_the_root(world4):
    """The probe's forward of the root unit gathers the root's parameters (the embedding and head of a
    large vocabulary): only modules holding a transformers model pay it."""
    assert world4.run(_root_calls_at_setup) == [0] * 4


@pytest.mark.parametrize(
    ("strategy", "kwargs", "error", "match"),
    [
        (
            MegatronCPFSDPStrategy,
            {"tp": 2},
            ValueError,
            r"MegatronCPFSDPStrategy\(tp=2\).*tensor parallelism",
        ),
        (
            MegatronCPFSDPStrategy,
            {"find_unused_parameters": True},
            TypeError,
            r"unexpected keyword argument\(s\) \['find_unused_parameters'\].*DDP options belong",
        ),
        (
            MegatronCPFSDPStrategy,
            {"fsdp_wrapper": ["Block"]},
            TypeError,
            r"unexpected keyword argument\(s\) \['fsdp_wrapper'\]",
        ),
        (
            MegatronCPFSDPStrategy,
            {"fsdp_wrap": [3]},
            TypeError,
            r"fsdp_wrap=\[3\]\): 3 is neither a module class nor a class name",
        ),
        (
            MegatronCPStrategy,
            {"fsdp": True},
            TypeError,
            r"fsdp=...\): FSDP is its own strategy, MegatronCPFSDP",
        ),
        (
            MegatronCPStrategy,
            {"fsdp_wrap": ["_Block"]},
            TypeError,
            r"fsdp_wrap=...\): FSDP is its own strategy",
        ),
        (
            MegatronCPFSDPStrategy,
            {"activation_checkpointing": [torch.Tensor]},
            TypeError,
            "activation_checkpoint",
        ),
        (
            MegatronCPFSDPStrategy,
            {"cpu_offload": "yes"},
            TypeError,
            r"MegatronCPFSDPStrategy\(cpu_offload='yes'\): give True or False",
        ),
        (
            MegatronCPFSDPStrategy,
            {"cpu_offload": True, "process_group_backend": "nccl"},
            ValueError,
            r"process_group_backend='nccl'\): .* give process_group_backend='cpu:gloo,cuda:nccl', or leave",
        ),
        (
            MegatronCPStrategy,
            {"cpu_offload": True},
            TypeError,
            r"MegatronCPStrategy\(cpu_offload=...\): DDP keeps .* use MegatronCPFSDPStrategy\(cpu_offload=True\)",
        ),
    ],
)
def test_bad_fsdp_arguments_fail_at_construction(strategy, kwargs, error, match):
    with pytest.raises(error, match=match):
        strategy(**kwargs)


def test_the_two_strategies_are_siblings_with_the_shared_arguments_declared_once():
    fsdp = MegatronCPFSDPStrategy(cp=2, fsdp_wrap="_Block", activation_checkpointing=["_Block"])
    assert (fsdp.cp, fsdp.tp, fsdp.fsdp_wrap, fsdp.activation_checkpointing) == (
        2,
        1,
        ("_Block",),
        ("_Block",),
    )
    assert not isinstance(fsdp, MegatronCPStrategy) and type(MegatronCPStrategy(cp=2)) is MegatronCPStrategy
    # Only MegatronCPBase declares cp, tp, ...; the siblings add what is theirs (fsdp_wrap) or nothing.
    assert "__init__" not in vars(MegatronCPStrategy)
    own = inspect.signature(MegatronCPFSDPStrategy.__init__).parameters
    assert [name for name in own if name not in ("self", "args", "kwargs")] == ["fsdp_wrap", "cpu_offload"]
    trainer = Trainer(accelerator="cpu", devices=2, strategy="megatron_cp_fsdp", logger=False)
    assert type(trainer.strategy) is MegatronCPFSDPStrategy and trainer.strategy.cp == 1


def test_the_default_units_are_the_no_split_modules_the_model_declares():
    class LlamaDecoderLayer(torch.nn.Linear):  # a class of that name, as a Hugging Face model holds
        pass

    decoder = torch.nn.Module()
    decoder._no_split_modules = [
        "LlamaDecoderLayer",
        "_Block",
        "VisionBlock",
    ]  # as Hugging Face models declare
    module = GPTModule(CONFIG)
    assert default_layer_classes(module) == ("_Block",)  # the package GPT's, without strategies importing it
    module.extra = decoder
    module.layer = LlamaDecoderLayer(2, 2)
    # Each name once, in the order found; a class the model does not hold (a composite's vision blocks, in
    # its text model's list) left out.
    assert default_layer_classes(module) == ("_Block", "LlamaDecoderLayer")
    assert default_layer_classes(torch.nn.Linear(2, 2)) == ()


def test_an_untied_token_embedding_is_a_unit_of_its_own_and_a_tied_one_stays_in_the_root():
    transformers = pytest.importorskip("transformers")
    config = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1}
    config |= {"num_attention_heads": 2, "num_key_value_heads": 1}
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=False))
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=True))
    holder = torch.nn.Module()  # a LightningModule holding the model: the embedding found once
    holder.model = untied
    assert _fsdp.untied_token_embeddings(holder) == [untied.model.embed_tokens]
    assert _fsdp.untied_token_embeddings(tied) == []  # the head reads the same weight
    assert _fsdp.untied_token_embeddings(GPTModule(CONFIG)) == []  # no get_input_embeddings


def test_the_device_mesh_is_not_available_before_setup():
    with pytest.raises(RuntimeError, match="device_mesh before the processes have initialized"):
        _ = MegatronCPFSDPStrategy(cp=2).device_mesh


def test_under_cpu_offload_a_cuda_world_gets_gloo_for_the_host_tensors_beside_nccl():
    """The choice the ranks make in ``setup_distributed`` (Lightning's default, or the one given)."""
    cuda = {"accelerator": "cuda", "parallel_devices": [torch.device("cuda", 0)]}
    offloaded = MegatronCPFSDPStrategy(cpu_offload=True, **cuda)
    assert offloaded._get_process_group_backend() == "cpu:gloo,cuda:nccl"
    assert MegatronCPFSDPStrategy(**cuda)._get_process_group_backend() == "nccl"
    given = MegatronCPFSDPStrategy(cpu_offload=True, process_group_backend="cuda:nccl,cpu:gloo", **cuda)
    assert given._get_process_group_backend() == "cuda:nccl,cpu:gloo"
    cpu = MegatronCPFSDPStrategy(cpu_offload=True, accelerator="cpu", parallel_devices=[torch.device("cpu")])
    assert cpu._get_process_group_backend() == "gloo"


def test_the_host_shards_are_pinned_for_a_cuda_device():
    """Page-locked host memory lets FSDP's copies to and from a GPU run asynchronously; the CPU needs none."""
    assert _fsdp.offload_policy(True, torch.device("cuda", 0)) == CPUOffloadPolicy(pin_memory=True)
    assert _fsdp.offload_policy(True, torch.device("cpu")) == CPUOffloadPolicy(pin_memory=False)
    assert _fsdp.offload_policy(False, torch.device("cuda", 0)) == OffloadPolicy()


@pytest.mark.parametrize("cpu_offload", [True, False], ids=["cpu-offload", "on-device"])
def test_under_cpu_offload_model_to_device_moves_everything_but_the_parameters(cpu_offload):
    """The strategy's ``model_to_device``, with the meta device as a stand-in for CUDA: the buffers, a
    metric's states and the module's ``device`` move; the parameters stay on the host under ``cpu_offload``
    (FSDP then shards them one unit at a time), and move without it."""
    meta = torch.device("meta")
    strategy = MegatronCPFSDPStrategy(cpu_offload=cpu_offload, accelerator="cpu", parallel_devices=[meta])
    module = GPTModule(CONFIG)
    module.register_buffer("table", torch.ones(3))
    module.model.blocks[0].mean = MeanMetric()
    strategy.model = module
    strategy.model_to_device()
    assert {p.device.type for p in module.parameters()} == {"cpu" if cpu_offload else "meta"}
    assert {b.device.type for b in module.buffers()} == {"meta"}
    assert module.model.blocks[0].mean.mean_value.device.type == "meta"  # a state, not a buffer
    assert (
        module.device.type == "meta"
    )  # where a step puts what it creates (torch.zeros(..., device=self.device))


def _fit_on_one_gpu(cpu_offload):
    """Three steps on one GPU in this process: bf16-mixed, clipping (a global norm of the host gradients),
    the tied head a unit of its own (the loss copies its host shard to the GPU). The process group is
    destroyed after, so that the next fit initializes its own (the backends differ)."""
    environment = dict(os.environ)
    seed_everything(0)
    recorder, probe = _Recorder(), _Probe()
    trainer = quiet_trainer(
        accelerator="cuda",
        strategy=MegatronCPFSDPStrategy(cpu_offload=cpu_offload, fsdp_wrap=["_Block", "Embedding"]),
        precision="bf16-mixed",
        max_steps=3,
        gradient_clip_val=0.05,
        callbacks=[recorder, probe],
    )
    try:
        trainer.fit(GPTModule(CONFIG, lr=LR), _loader(GLOBAL_BATCH, False))
        backends = set(dist.get_backend_config().split(","))
        # After the teardown, which moved the shards to the host: gathered over NCCL all the same.
        weights = trainer.strategy.full_state_dict()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    return recorder.losses, probe, backends, weights


@pytest.mark.gpu
def test_cpu_offload_keeps_no_model_state_on_the_gpu_between_steps_and_trains_the_same():
    """Between steps every parameter, gradient and AdamW tensor is in host memory, the parameter shards
    pinned (FSDP's copies to the GPU run asynchronously from them); the same look sees them on the GPU
    without ``cpu_offload``, whose losses are the same."""
    losses, probe, backends, weights = _fit_on_one_gpu(cpu_offload=True)
    assert {(kind, device) for kind, device, _ in probe.state} == {(kind, "cpu") for kind in _STATE_KINDS}
    assert all(pinned for kind, _, pinned in probe.state if kind == "parameter")
    assert probe.module_device == "cuda"  # what the step creates goes where its batch is
    assert backends == {"cpu:gloo", "cuda:nccl"}
    on_device_losses, on_device, _, on_device_weights = _fit_on_one_gpu(cpu_offload=False)
    assert {device for kind, device, _ in on_device.state if kind != "step"} == {"cuda"}  # AdamW's step: host
    # full_state_dict after fit: every tensor in host memory, either way.
    assert weights.keys() == on_device_weights.keys() == GPTModule(CONFIG).state_dict().keys()
    assert {t.device.type for t in [*weights.values(), *on_device_weights.values()]} == {"cpu"}
    # The host's AdamW and clipping norm round in another order than the GPU's; a weight's bf16 copy may
    # round the other way: far below a 1% error.
    assert losses == pytest.approx(on_device_losses, rel=1e-3)


class _EagerOptimizerState(GPTModule):
    """``GPTModule`` with Adagrad, whose state (each parameter's running sum of squares) exists from the
    optimizer's construction on: a move of the optimizer state at setup moves tensors."""

    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=LR)


def _optimizer_state_moves():
    """One step under ``MegatronCPFSDPStrategy(cpu_offload=True)``: the device types Lightning's mover of an
    optimizer's state (``_optimizer_to_device``, which every strategy's move goes through) was asked for while
    the optimizer had state, until training ended and after (Lightning's teardown)."""
    import lightning.fabric.utilities.optimizer as fabric_optimizer
    import lightning.pytorch.strategies.strategy as base_strategy

    moves, phase = {"training": [], "teardown": []}, ["training"]
    original = fabric_optimizer._optimizer_to_device

    def recording(optimizer, device):
        if optimizer.state:
            moves[phase[0]].append(torch.device(device).type)
        original(optimizer, device)

    class _TrainingEnds(Callback):
        def on_train_end(self, trainer, pl_module):
            phase[0] = "teardown"

    fabric_optimizer._optimizer_to_device = base_strategy._optimizer_to_device = recording
    try:
        seed_everything(0)
        strategy = MegatronCPFSDPStrategy(cpu_offload=True)
        trainer = _trainer(1, strategy=strategy, max_steps=1, callbacks=[_TrainingEnds()])
        trainer.fit(_EagerOptimizerState(CONFIG), _loader(GLOBAL_BATCH, False))
    finally:
        fabric_optimizer._optimizer_to_device = base_strategy._optimizer_to_device = original
    return moves


def test_under_cpu_offload_the_optimizer_state_is_never_moved_to_the_compute_device(world1):
    """The optimizer's state stays with the parameter shards in host memory: from setup (the optimizer's state
    exists then) to the end of training nothing moves it to the compute device, which here is the host too,
    so the mover's calls are what shows it (Lightning's teardown moving it to the host is one, which shows
    they are seen; without ``cpu_offload`` the setup's move to the compute device is another)."""
    assert world1.run(_optimizer_state_moves) == [{"training": [], "teardown": ["cpu"]}]
