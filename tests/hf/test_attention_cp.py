"""``attn_implementation="lightning_cp"`` under CP (gloo pools): the shard given as ``cp_shard`` is exact.

References are ``transformers``' own ``"sdpa"`` models with the same weights, on whole sequences or on
each document alone, in the test process.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_cp.hf import decoder, output_head
from lightning_cp.hf.mixers import adapt_token_mixers
from lightning_cp.hf.sharded_calls import guard_sharded_calls
from lightning_cp.parallel import context_parallel_attention, groups, shard_batch
from lightning_cp.parallel.attention_mode import AttentionMode
from lightning_cp.parallel.layout import current_layout, set_current_layout
from tests.hf._models import CONFIGS, VARIANTS, VOCAB, assert_grads_close, build, build_variant
from tests.hf.test_hybrid import HYBRIDS, transformers

DOC_LENGTHS = [7, 13, 5, 11]  # odd and unequal: every CP split pads, pieces straddle ranks
PADDED_SHAPE = (3, 10)


def _inputs():
    """A packed row of DOC_LENGTHS documents and a padded [3, 10] batch, full (unsharded)."""
    generator = torch.Generator().manual_seed(1)
    packed = torch.randint(0, VOCAB, (1, sum(DOC_LENGTHS)), generator=generator)
    cu = torch.tensor([0, *DOC_LENGTHS]).cumsum(0).to(torch.int32)
    padded = torch.randint(0, VOCAB, PADDED_SHAPE, generator=generator)
    return {"input_ids": packed, "cu_seqlens": cu}, {"input_ids": padded}


def _nll(model, batch):
    """Per-sequence NLL sums of this rank's shard ``[n]`` (rows, or packed documents)."""
    hidden = model.model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], cp_shard=batch["cp_shard"]
    ).last_hidden_state
    nll = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), batch["labels"].flatten(), reduction="none")
    shard = batch["cp_shard"]
    return torch.zeros(shard.num_sequences).index_add(0, shard.sequence_index, nll)


def _summed_over_cp(losses, models):
    """The per-sequence losses and each model's gradients, added up over the CP group."""
    losses = [loss.detach() for loss in losses]
    for tensor in [*losses, *(p.grad for model in models for p in model.parameters())]:
        dist.all_reduce(tensor, group=current_layout().cp_group)
    return losses, [{k: p.grad for k, p in model.named_parameters()} for model in models]


def _in_cp_group(cp, fn):
    layout = groups.initialize(tp=1, cp=cp)
    set_current_layout(layout)
    try:
        return fn(layout.cp_rank)
    finally:
        set_current_layout(None)


def _packed_documents(name, cp):
    def run(rank):
        torch.manual_seed(0)
        model = build(name, "lightning_cp")
        losses = _nll(model, shard_batch(_inputs()[0], cp, rank, cp_group=current_layout().cp_group))
        losses.sum().backward()
        return _summed_over_cp([losses], [model])

    return _in_cp_group(cp, run)


def _reference_nll(model, ids):
    """Per-row NLL sums of ``transformers``' own loss on whole sequences (every next token a target)."""
    return torch.stack([model(input_ids=row[None], labels=row[None]).loss * (len(row) - 1) for row in ids])


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_documents_equal_each_document_alone(world4, name):
    torch.manual_seed(0)
    reference = build(name, "sdpa")
    documents = _inputs()[0]["input_ids"].split(DOC_LENGTHS, dim=1)
    expected = torch.cat([_reference_nll(reference, document) for document in documents])
    expected.sum().backward()
    for cp in (2, 4):
        (losses,), (grads,) = world4.run(_packed_documents, name, cp)[0]
        torch.testing.assert_close(losses, expected.detach(), rtol=1e-5, atol=1e-5, msg=f"cp={cp}")
        for key, param in reference.named_parameters():
            torch.testing.assert_close(grads[key], param.grad, rtol=1e-4, atol=1e-6, msg=f"cp={cp} {key}")


def _variant_documents(name, cp):
    def run(rank):
        torch.manual_seed(0)
        model = build_variant(name, "lightning_cp")
        batch = shard_batch(_inputs()[0], cp, rank, cp_group=current_layout().cp_group)
        hidden = decoder(model)(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            cp_shard=batch["cp_shard"],
            use_cache=False,
        ).last_hidden_state
        logits = output_head(model).logits(hidden)  # the final softcap of Gemma-2 included
        nll = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
        shard = batch["cp_shard"]
        losses = torch.zeros(shard.num_sequences).index_add(0, shard.sequence_index, nll)
        losses.sum().backward()
        return _summed_over_cp([losses], [model])

    return _in_cp_group(cp, run)


@pytest.mark.parametrize("variant", VARIANTS)
def test_layer_variants_with_packed_documents_equal_each_document_alone(world4, variant):
    # Sliding windows shorter than the documents and than a CP chunk, softcapping, a scaling of the
    # layer's own, attention sinks, a value head dim of its own: through the model at cp 2 and 4.
    torch.manual_seed(0)
    reference = build_variant(variant, None)
    documents = _inputs()[0]["input_ids"].split(DOC_LENGTHS, dim=1)
    expected = torch.cat([_reference_nll(reference, document) for document in documents])
    expected.sum().backward()
    want = {key: p.grad for key, p in reference.named_parameters() if p.grad is not None}
    for cp in (2, 4):
        (losses,), (grads,) = world4.run(_variant_documents, variant, cp)[0]
        torch.testing.assert_close(losses, expected.detach(), rtol=1e-5, atol=1e-5, msg=f"cp={cp}")
        assert_grads_close(grads, want)


def _two_models(cp):
    # Two models, each with its own batch, forward passes interleaved before one backward.
    def run(rank):
        torch.manual_seed(0)
        llama, qwen3 = build("llama", "lightning_cp"), build("qwen3", "lightning_cp")
        group = current_layout().cp_group
        packed, padded = (shard_batch(batch, cp, rank, cp_group=group) for batch in _inputs())
        losses = [_nll(llama, packed), _nll(qwen3, padded)]
        sum(loss.sum() for loss in losses).backward()
        return _summed_over_cp(losses, [llama, qwen3])

    return _in_cp_group(cp, run)


def test_two_models_with_their_own_batches(world2):
    torch.manual_seed(0)
    references = build("llama", "sdpa"), build("qwen3", "sdpa")
    packed, padded = _inputs()
    expected = [
        torch.cat([_reference_nll(references[0], d) for d in packed["input_ids"].split(DOC_LENGTHS, 1)]),
        _reference_nll(references[1], padded["input_ids"]),
    ]
    sum(loss.sum() for loss in expected).backward()
    losses, grads = world2.run(_two_models, 2)[0]
    for loss, want, model_grads, reference in zip(losses, expected, grads, references):
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
        for key, param in reference.named_parameters():
            torch.testing.assert_close(model_grads[key], param.grad, rtol=1e-4, atol=1e-6, msg=key)


def _without_position_ids(cp):
    def run(rank):
        torch.manual_seed(0)
        model = build("qwen3", "lightning_cp")
        batch = shard_batch(_inputs()[1], cp, rank, cp_group=current_layout().cp_group)
        try:
            model.model(input_ids=batch["input_ids"], cp_shard=batch["cp_shard"])
        except ValueError as error:
            return str(error)
        return None

    return _in_cp_group(cp, run)


def test_a_model_called_without_position_ids_under_cp_fails_on_every_rank(world2):
    for message in world2.run(_without_position_ids, 2):
        assert message is not None and "position_ids=batch['position_ids']" in message


def _right_padded_batch(cp, rank, **tensors):
    """A [2, 8] batch whose second row ends in two padding tokens, sharded with its attention_mask (and
    ``tensors``): at cp = 2 the last chunk (tokens 6, 7), and so every zero of the mask, is rank 0's."""
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, -2:] = 0
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "attention_mask": mask, **tensors}
    return shard_batch(batch, cp, rank, cp_group=current_layout().cp_group)


def _error(call):
    """The message of the ``ValueError`` ``call()`` raises, or None."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return None


def _right_padded(cp):
    """The sharded attention_mask given to a bare decoder and, as bool (what transformers hands its
    attention function), to a guarded one: whether this rank's slice masks nothing, and each error."""

    def run(rank):
        torch.manual_seed(0)
        batch = _right_padded_batch(cp, rank)
        messages = []
        for guarded, local_mask in ((False, batch["attention_mask"]), (True, batch["attention_mask"].bool())):
            model = build("llama", "lightning_cp")
            if guarded:
                guard_sharded_calls(model)
            inputs = {name: batch[name] for name in ("input_ids", "position_ids", "cp_shard")}
            messages.append(_error(lambda: model.model(**inputs, attention_mask=local_mask)))  # noqa: B023
        return bool(batch["attention_mask"].all()), messages

    return _in_cp_group(cp, run)


def test_right_padding_in_one_rank_s_slice_is_refused_on_every_rank(world2):
    per_rank = world2.run(_right_padded, 2)
    assert [all_ones for all_ones, _ in per_rank] == [False, True]  # only rank 0's slice has the zeros
    for _, messages in per_rank:
        assert messages[0] is not None and "Do not pass attention_mask to the model" in messages[0]
        assert messages[1] is not None and messages[1].startswith("LlamaModel: ")
        assert "Do not pass attention_mask to the model" in messages[1]


def _mixer_given_the_padding(cp):
    """A Gated DeltaNet layer called with the right-padded batch's attention_mask slice and cp_shard: each
    rank's error, or None."""

    def run(rank):
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(**HYBRIDS["qwen3_5_text"])
        model = transformers.AutoModelForCausalLM.from_config(config)
        mixer = model.get_submodule(adapt_token_mixers(model, cp)[0])
        batch = _right_padded_batch(cp, rank, h=torch.randn(2, 8, config.hidden_size))
        return _error(
            lambda: mixer(batch["h"], attention_mask=batch["attention_mask"], cp_shard=batch["cp_shard"])
        )

    return _in_cp_group(cp, run)


def test_a_mixer_refuses_the_batch_s_padding_on_every_rank(world2):
    for message in world2.run(_mixer_given_the_padding, 2):
        assert message is not None and "got a padding mask with cp_shard" in message


def _index_copies_per_layer(cp):
    """Integer ``.to`` calls (the index copies to the device) of two calls ("layers") on one batch's shard
    of Ulysses attention with sinks and of each kind of token mixer (Gated DeltaNet's, Mamba2's and the
    short convolution's channel rows, Mamba2's own heads)."""

    def run(rank):
        torch.manual_seed(0)
        group = current_layout().cp_group
        ids = torch.zeros(1, 16, dtype=torch.long)
        cu = torch.tensor([0, 5, 16])
        copies = {}

        def layers(name, layer):
            counts = []
            for _ in range(2):
                with _counting_index_copies() as count:
                    layer()
                counts.append(count[0])
            copies[name] = counts

        q, k, v = (torch.randn(1, heads, 16, 8) for heads in (4, 2, 2))
        batch = shard_batch(
            {
                "input_ids": ids,
                "cu_seqlens": cu,
                "q": q.transpose(1, 2),
                "k": k.transpose(1, 2),
                "v": v.transpose(1, 2),
            },
            cp,
            rank,
            cp_group=group,
            attention=AttentionMode("ulysses"),
        )
        local = [batch[name].transpose(1, 2) for name in "qkv"]
        sinks = torch.randn(4)
        layers("ulysses", lambda: context_parallel_attention(*local, cp_shard=batch["cp_shard"], sinks=sinks))
        for family in ("qwen3_5_text", "mamba2", "lfm2"):
            config = transformers.AutoConfig.for_model(**HYBRIDS[family])
            model = transformers.AutoModelForCausalLM.from_config(config)
            mixer = model.get_submodule(adapt_token_mixers(model, cp)[0])
            hidden = torch.randn(1, 16, config.hidden_size)
            batch = shard_batch({"input_ids": ids, "cu_seqlens": cu, "h": hidden}, cp, rank, cp_group=group)
            layers(family, lambda: mixer(batch["h"], cp_shard=batch["cp_shard"]))  # noqa: B023
        return copies

    return _in_cp_group(cp, run)


@contextlib.contextmanager
def _counting_index_copies():
    count = [0]
    to = torch.Tensor.to

    def counted(self, *args, **kwargs):
        if not self.is_floating_point() and self.dtype != torch.bool:
            count[0] += 1
        return to(self, *args, **kwargs)

    torch.Tensor.to = counted
    try:
        yield count
    finally:
        torch.Tensor.to = to


def test_index_tensors_are_copied_to_the_device_once_per_batch_not_per_layer(world2):
    for copies in world2.run(_index_copies_per_layer, 2):
        for name, (first, second) in copies.items():
            assert first > 0 and second == 0, (
                f"{name}: {first} copies in the first layer, {second} in the second"
            )
