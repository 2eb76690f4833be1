"""The strategy's setup probe: each ``transformers`` model trains exactly under CP, or is refused with the reason.

Whether a model is exact under context parallelism is decided by what it does, not by its class: at
setup every rank runs a small probe (two documents of odd lengths, packed in one row; eval mode, no
gradients) through each ``transformers`` model of the ``LightningModule`` twice:

* the **sharded** path, as training runs it: the decoder body on this rank's shard of the packed row,
  with ``cp_shard`` and the batch's ``position_ids``, CP attention over the real CP group;
* the **unsharded** path: the whole causal LM on each document alone, without ``cp_shard`` (plain SDPA).

Forward hooks record every submodule's output that has the token layout ``[1, tokens, ...]``; the
sharded ones are all-gathered over CP, reassembled (:func:`~lightning_cp.parallel.unshard`) and compared
with the unsharded ones module by module in execution order. The first module that differs is named: a
Mamba mixer, a short convolution, linear attention, an attention class outside ``transformers``'
attention interface, ALiBi, a position encoding computed from the tokens a rank sees. A crash of the
sharded path is a refusal with the exception's first line. The output path is checked on every CP size:
the model's own logits against what the loss computes from the last hidden states with
:func:`~lightning_cp.hf.output_head` (weight, bias, logit scale, softcap), after checking that the output
embeddings are a plain linear layer (no parameters or forward of their own); a transform it misses is a
refusal, and a head that needs transforms is marked so that the loss refuses its bare weight.

What a short probe cannot show is checked on the config (:mod:`lightning_cp.hf.check`): RoPE scalings
that pick their frequencies from the sequence length, chunked attention, attention dropout.

The strategies call both through the ``transformers`` integration (:mod:`lightning_cp.hf.integration`,
with the token mixers adapted in between). Under DDP :func:`check_configs` runs before wrapping and
:func:`probe_models` on the whole models; under FSDP :func:`check_configs` runs before sharding and
:func:`probe_models` after it, inside the root unit's forward, so
that models loaded shard by shard (:func:`~lightning_cp.load_pretrained`) are probed too, and the head's
mark (:meth:`~lightning_cp.ops.OutputHead.mark_weight`) lands on the gathered weight the loss is given.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_cp.constants import CP_SHARD, CU_SEQLENS, INPUT_IDS, POSITION_IDS
from lightning_cp.hf.causal_lm import decoder, output_head
from lightning_cp.hf.check import (
    check_attention_is_context_parallel,
    check_config_is_context_parallel,
    check_token_mixers,
)
from lightning_cp.hf.lora import check_adapters
from lightning_cp.parallel.broadcast import broadcast_tensors
from lightning_cp.parallel.layout import ParallelLayout
from lightning_cp.parallel.sharding import shard_batch, unshard

PROBE_LENGTHS = (13, 22)
"""Token counts of the probe's two documents: odd splits, pieces that straddle ranks, unlike any width."""

# Relative error (in norm) above which an output differs: far above the round-off of CP attention
# against SDPA (~1e-7 in fp32, ~1e-2 after a few bf16 layers), far below what a module that sees only
# part of the sequence changes (tens of percent).
_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}
_LOW_PRECISION_TOLERANCE = 5e-2


@dataclass(frozen=True)
class _Recorded:
    """A module's token-layout outputs ``[1, tokens, ...]`` of one pass, by ``(module name, call)``: the call's
    string positional arguments and its index among the calls with those arguments."""

    outputs: dict[tuple[str, str], Tensor]


def check_configs(module: nn.Module, cp: int) -> None:
    """The checks that need no weights, for ``cp`` ranks per sequence: :func:`~lightning_cp.hf.check_attention_is_context_parallel`
    (cp > 1), and for every ``transformers`` model in ``module`` (the outermost ones: a causal LM, a teacher,
    a user's own) :func:`~lightning_cp.hf.check.check_config_is_context_parallel` (what a short probe
    cannot show), :func:`~lightning_cp.hf.check.check_token_mixers` (Mamba1, mixers whose heads do not
    split) and :func:`~lightning_cp.hf.lora.check_adapters` (LoRA dropout under CP, DoRA, adapters on
    layers other than linear ones and embeddings). They read classes, configs and sizes only, so they also
    run on a ``meta`` build. No communication.

    Raises:
        ValueError: naming the model, the attribute or module and what to change.
    """
    check_attention_is_context_parallel(module, cp)
    for where, model in transformers_models(module):
        check_config_is_context_parallel(model, where, cp)
        check_token_mixers(model, where, cp)
        check_adapters(model, where, cp)


def probe_models(module: nn.Module, layout: ParallelLayout, device: torch.device) -> None:
    """The behavioural probe of this module's docstring on every ``transformers`` model in ``module``: whole
    (moved to ``device``, the strategy's root device, where setup moves them next anyway, so that the
    probe's collectives run on the CP group's backend), or sharded by FSDP2 on ``device``, in which case
    this must run inside the FSDP root's forward (the root unit's parameters gathered; every inner unit
    gathers its own as it runs).

    Communication over ``layout.cp_group``: one ``all_gather_object`` and one all-gather per compared
    module output; for whole models an all-gather of checksums of the weights (and broadcasts of CP rank
    0's weights where they differ); for sharded ones FSDP's own all-gathers, the same on every rank.

    Raises:
        ValueError: naming the model, the first module that differs (or the exception of the sharded
            pass) and what to change; also for a model whose parameters are on the meta device (only
            :class:`~lightning_cp.MegatronCPFSDPStrategy` materializes those, before probing them).
    """
    for where, model in transformers_models(module):
        if any(p.is_meta for p in model.parameters()):
            raise ValueError(
                f"{where} ({type(model).__name__}) has parameters on the meta device: only "
                "MegatronCPFSDPStrategy fills a model built by lightning_cp.load_pretrained shard by shard; "
                "elsewhere build it outside the strategy's model_sharded_context."
            )
        if not any(isinstance(p, DTensor) for p in model.parameters()):
            model.to(device)
        _probe(model, where, layout, device)


def holds_transformers_models(module: nn.Module) -> bool:
    """Whether ``module`` holds a ``transformers`` model: one :func:`probe_models` would probe. No communication."""
    return next(transformers_models(module), None) is not None


def transformers_models(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The outermost ``transformers`` models in ``module`` (a causal LM, a teacher), by name (``module``'s
    class name for ``module`` itself)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:  # transformers never loaded: no model of it can exist
        return
    outer: list[str] = []
    for name, child in module.named_modules():
        inside = any(o == "" or name.startswith(f"{o}.") for o in outer)
        if isinstance(child, modeling.PreTrainedModel) and not inside:
            outer.append(name)
            yield name or type(module).__name__, child


def _probe(model: nn.Module, where: str, layout: ParallelLayout, device: torch.device) -> None:
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            _same_weights_over_cp(model, layout)
            _check(model, where, layout, device)
    finally:
        for m, training in modes.items():
            m.training = training


def _check(model: nn.Module, where: str, layout: ParallelLayout, device: torch.device) -> None:
    name = f"{where} ({type(model).__name__})"
    body = decoder(model)
    head = output_head(model)
    vocab = head.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, sum(PROBE_LENGTHS)), generator=generator).to(device)
    cu_seqlens = torch.tensor([0, *PROBE_LENGTHS], device=device).cumsum(0).to(torch.int32)
    documents = ids.split(list(PROBE_LENGTHS), dim=1)
    _check_head_is_linear(name, model.get_output_embeddings())
    reference, hidden, logits = _unsharded(name, model, body, documents)
    _check_output_path(name, head, hidden, logits)
    head.mark_weight(type(model).__name__)
    sharded, error = _sharded(body, ids, cu_seqlens, layout)
    errors = _over_cp(error, layout)
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        raise ValueError(
            f"{name} fails on a batch sharded for context parallelism (cp={layout.cp}): {failed}. "
            "This model cannot be trained with lightning_cp's CP as it is."
        )
    if layout.cp > 1:
        _compare(name, body, reference, sharded, cu_seqlens, layout, head.weight.dtype)
        # The last hidden states, what the loss sees, whatever the modules compared above.
        last = _Recorded({("", "last"): hidden})
        _compare(
            name,
            body,
            last,
            _Recorded({("", "last"): _body_output(sharded)}),
            cu_seqlens,
            layout,
            head.weight.dtype,
        )


def _unsharded(
    name: str, model: nn.Module, body: nn.Module, documents: tuple[Tensor, ...]
) -> tuple[_Recorded, Tensor, Tensor]:
    """Each document alone through the whole model: the body's recorded outputs (documents concatenated),
    its last hidden states ``[1, T, H]`` and the model's logits ``[1, T, V]``."""
    passes, hiddens, logits = [], [], []
    for ids in documents:
        with _recording(body, ids.shape[1]) as recorded:
            try:
                out = model(input_ids=ids, use_cache=False, return_dict=True)
            except Exception as error:
                raise ValueError(
                    f"{name}: the setup probe could not run the model itself (without CP) on a "
                    f"{ids.shape[1]}-token sequence: {_first_line(error)}"
                ) from error
        passes.append(recorded)
        hiddens.append(_body_output(recorded))
        logits.append(out.logits)
    joined = {}
    for key, first in passes[0].outputs.items():
        parts = [p.outputs.get(key) for p in passes]
        if all(p is not None and p.shape[2:] == first.shape[2:] for p in parts):
            joined[key] = torch.cat(parts, dim=1)
    return _Recorded(joined), torch.cat(hiddens, dim=1), torch.cat(logits, dim=1)


def _body_output(recorded: _Recorded) -> Tensor:
    """The decoder body's own output (its one call of the pass): the last hidden states."""
    return next(t for (module, _), t in recorded.outputs.items() if module == "")


def _sharded(
    body: nn.Module, ids: Tensor, cu_seqlens: Tensor, layout: ParallelLayout
) -> tuple[_Recorded | None, str | None]:
    """The training path on this rank's shard of the packed probe; or the first line of its exception."""
    batch = shard_batch(
        {INPUT_IDS: ids, CU_SEQLENS: cu_seqlens}, layout.cp, layout.cp_rank, cp_group=layout.cp_group
    )
    try:
        with _recording(body, batch[INPUT_IDS].shape[1]) as recorded:
            body(
                input_ids=batch[INPUT_IDS],
                position_ids=batch[POSITION_IDS],
                cp_shard=batch[CP_SHARD],
                use_cache=False,
            )
    except Exception as error:  # noqa: BLE001 - any failure of the model is the refusal's reason
        return None, _first_line(error)
    return recorded, None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


@contextlib.contextmanager
def _recording(body: nn.Module, tokens: int) -> Iterator[_Recorded]:
    """Forward hooks on every submodule of ``body`` (``body`` itself is ``""``) that keep floating-point outputs
    with the token layout ``[1, tokens, ...]``, by module name and call index."""
    recorded, calls = _Recorded({}), {}

    def hook_of(name: str):
        def hook(_module: nn.Module, args: tuple, output: object) -> None:
            # Calls are told apart by their string arguments (Gemma-3 calls its rotary embedding once per
            # layer type, in an order that may differ between processes), then counted.
            plain = tuple(a for a in args if isinstance(a, str))
            call = (name, plain)
            index = calls[call] = calls.get(call, -1) + 1
            tensor = _first_tensor(output)
            # Activations only: integer outputs (a sparse-attention indexer's selected keys, which index the
            # sharded layout) are compared through the attention outputs they select.
            if tensor is not None and tensor.is_floating_point() and tensor.shape[:2] == (1, tokens):
                recorded.outputs[(name, f"{plain}#{index}")] = tensor.detach().clone()

        return hook

    handles = [module.register_forward_hook(hook_of(name)) for name, module in body.named_modules()]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def _first_tensor(output: object) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    values = (
        output.values() if isinstance(output, dict) else output if isinstance(output, tuple | list) else ()
    )
    return next((v for v in values if isinstance(v, Tensor)), None)


def _same_weights_over_cp(model: nn.Module, layout: ParallelLayout) -> None:
    """Give every CP rank CP rank 0's parameters and buffers if they differ (as DDP and FSDP do next, over
    DP x CP): the sharded outputs of ranks with other weights could not be compared. One all-gather of a
    checksum per tensor; the broadcasts only when the checksums differ."""
    if layout.cp_group is None or any(isinstance(p, DTensor) for p in model.parameters()):
        return  # FSDP's shards of one tensor came from one checkpoint, or from a broadcast before sharding
    tensors = [*model.parameters(), *model.buffers()]
    sums = torch.stack([t.detach().double().sum() for t in tensors]) if tensors else torch.zeros(0)
    gathered = [torch.empty_like(sums) for _ in range(layout.cp)]
    dist.all_gather(gathered, sums, group=layout.cp_group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    broadcast_tensors(tensors, dist.get_global_rank(layout.cp_group, 0), layout.cp_group)


def _over_cp(value: object, layout: ParallelLayout) -> list:
    """Every CP rank's ``value`` (one ``all_gather_object`` over the CP group; ``[value]`` without CP)."""
    if layout.cp_group is None:
        return [value]
    values = [None] * layout.cp
    dist.all_gather_object(values, value, group=layout.cp_group)
    return values


def _differs(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> bool:
    tolerance = _TOLERANCE.get(dtype, _LOW_PRECISION_TOLERANCE)
    actual, expected = actual.double(), expected.double()
    error = torch.linalg.vector_norm(actual - expected)
    return not bool(error <= tolerance * torch.linalg.vector_norm(expected) + 1e-30)


def _check_head_is_linear(name: str, embeddings: nn.Module) -> None:
    """Refuse output embeddings that compute more than ``hidden @ weight.T + bias``: parameters of their own
    (a learned logit scale, LoRA) or a forward of their own, which the fused loss would not apply. A
    transform that is the identity at initialization (a learned scale starting at 1) gives the model's own
    logits in the probe, yet its parameters would never train."""
    extra = sorted(n for n, _ in embeddings.named_parameters() if n not in ("weight", "bias"))
    if extra or type(embeddings).forward is not nn.Linear.forward:
        what = f"parameters {', '.join(extra)}" if extra else "a forward of their own"
        raise ValueError(
            f"{name}: its output embeddings ({type(embeddings).__name__}) are not a plain nn.Linear ({what}): "
            "the fused loss computes only their weight and bias (then the config's logit scale and softcap), "
            "so the rest would not be applied or trained. Train it without lightning_cp's loss."
        )


def _check_output_path(name: str, head, hidden: Tensor, logits: Tensor) -> None:
    if hidden.shape[-1] != head.weight.shape[1]:
        raise ValueError(
            f"{name}: its decoder body gives hidden states of size {hidden.shape[-1]}, but its output "
            f"embeddings take {head.weight.shape[1]}: a layer between them (a prediction head) is not part of "
            "what the fused loss computes. Train it without lightning_cp's loss."
        )
    if logits.shape[-1] != head.weight.shape[0] or _differs(
        head.logits(hidden), logits.float(), head.weight.dtype
    ):
        raise ValueError(
            f"{name}: its logits are not what the fused loss computes from the last hidden states with "
            f"lightning_cp.hf.output_head (the output embeddings' weight, then {head.describe()}): the model "
            "transforms them in a way the loss does not apply, and would train another objective. Train it "
            "without lightning_cp's loss, or build the matching lightning_cp.ops.OutputHead yourself."
        )


def _compare(
    name: str,
    body: nn.Module,
    reference: _Recorded,
    sharded: _Recorded,
    cu_seqlens: Tensor,
    layout: ParallelLayout,
    dtype: torch.dtype,
) -> None:
    """Gather the sharded outputs over CP and raise at the first module that differs from the reference."""
    mine = [(key, tuple(t.shape[2:])) for key, t in sharded.outputs.items()]
    every = _over_cp(mine, layout)
    common = set(mine).intersection(*map(set, every))
    modules = dict(body.named_modules())
    # In CP rank 0's execution order on every rank, so that the all-gathers match.
    for key, shape in every[0]:
        expected = reference.outputs.get(key)
        if (key, shape) not in common or expected is None or tuple(expected.shape[2:]) != shape:
            continue
        local = sharded.outputs[key].contiguous()
        shards = [torch.empty_like(local) for _ in range(layout.cp)]
        dist.all_gather(shards, local, group=layout.cp_group)
        if _differs(unshard(shards, cu_seqlens=cu_seqlens), expected, dtype):
            where = _mixing_module(key[0], modules)
            raise ValueError(
                f"{name}: {where or 'the decoder body'} ({type(modules[where]).__name__}) gives other outputs "
                f"under context parallelism (cp={layout.cp}) than in the unsharded model, so training would "
                f"be silently wrong: it {_reason(type(modules[where]).__name__)}. lightning_cp's CP cannot "
                "train this model exactly: train it with cp=1."
            )


# Modules that transform each token on its own: when one of them is the first to differ, its input
# came from its parent's own code (e.g. the attention computed between q_proj and o_proj). Norms and
# transformers' Conv1D (GPT-2's linear layer) are recognized by their class names.
_PER_TOKEN = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Dropout, nn.Identity)


def _mixing_module(name: str, modules: dict[str, nn.Module]) -> str:
    """The module whose own computation mixed tokens: ``name``, or its parent when ``name`` is per-token."""
    module = modules[name]
    class_name = type(module).__name__
    per_token = isinstance(module, _PER_TOKEN) or "Norm" in class_name or class_name == "Conv1D"
    if name and per_token and not any(module.children()):
        return name.rpartition(".")[0]
    return name


# What a module of this kind does that CP cannot reproduce, by a part of its class name (first match).
_REASONS = (
    (("rotary", "rope"), "computes position encodings from the tokens this rank holds"),
    (
        ("mamba", "ssm", "mixer"),
        "is a state-space (Mamba) layer, whose recurrence over the sequence sees one shard",
    ),
    (("delta", "linear", "lightning"), "is linear attention, whose recurrent state runs over the sequence"),
    (("lru", "lstm", "rnn", "recurrent"), "is a recurrent layer, whose state runs over the sequence"),
    (("conv",), "convolves over the sequence within one shard"),
    (("pad", "shift"), "shifts tokens along the sequence within one shard"),
    (
        ("attention", "attn"),
        "computes attention outside transformers' attention interface (or adds a bias such as ALiBi)",
    ),
)


def _reason(class_name: str) -> str:
    lower = class_name.lower()
    for parts, reason in _REASONS:
        if any(part in lower for part in parts):
            return reason
    return (
        "mixes tokens along the sequence outside transformers' attention interface (a state-space layer, "
        "linear attention, a convolution over time, an attention of its own) or computes positions from "
        "the tokens this rank holds"
    )
