"""The two halves of a ``transformers`` causal LM under the fused loss: its decoder body and its output head.

A training step runs the decoder body on the shard and hands its last hidden states, with the output
head, to :meth:`~lightning_cp.CPLossMixin.lm_loss`::

    out = decoder(model)(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         cp_shard=batch["cp_shard"], use_cache=False)
    loss = self.lm_loss(out.last_hidden_state, output_head(model), batch)

Both come from the model's own accessors (``get_decoder()``, ``get_output_embeddings()``, the config),
not from attribute names: the body is ``model.model`` in Llama, ``model.transformer`` in GPT-2 and Falcon,
``model.gpt_neox`` in GPT-NeoX.
"""

from __future__ import annotations

from torch import nn

from lightning_cp.ops.output_head import OutputHead

# Config names of the final logit softcapping: Gemma-2/3, RecurrentGemma, xLSTM.
_SOFTCAPS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")


def decoder(model: nn.Module) -> nn.Module:
    """The decoder body of ``model`` (its last hidden states, before the output head).

    ``model.get_decoder()`` where it gives a model (every ``transformers`` causal LM), else its
    ``base_model`` (ModernBERT-decoder's ``get_decoder()`` is its output projection, named ``decoder``); a
    model without a head is its own body.

    Raises:
        TypeError: ``model`` is not a ``transformers`` model (neither accessor exists).
    """
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not hasattr(body, "config"):
        body = getattr(model, "base_model", None)
    if body is None:
        raise TypeError(
            f"{type(model).__name__} has neither get_decoder() nor base_model: pass a transformers model "
            "(e.g. AutoModelForCausalLM)."
        )
    return body


def output_head(model: nn.Module) -> OutputHead:
    """The :class:`~lightning_cp.ops.OutputHead` that turns ``model``'s last hidden states into its logits.

    The weight and bias of ``model.get_output_embeddings()``, and the transforms the causal LM applies
    after it, read from its (text) config: ``logit_scale`` (Cohere: a multiplier), ``logits_scaling``
    (Granite: a divisor), ``lm_head_multiplier`` (Falcon-H1's muP multiplier) and the final logit softcapping (``final_logit_softcapping`` of Gemma-2 and
    Gemma-3, ``logits_soft_cap`` of RecurrentGemma, ``output_logit_soft_cap`` of xLSTM). Under CP the strategy's probe
    holds this head against the model's own logits, so a transform missing here is a refusal at setup,
    never a silently different objective. Local, no communication.

    Raises:
        ValueError: the model has no output embeddings.
    """
    embeddings = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embeddings is None or not hasattr(embeddings, "weight"):
        raise ValueError(
            f"{type(model).__name__} has no output embeddings (get_output_embeddings() is {embeddings!r}): "
            "use a causal LM class (AutoModelForCausalLM), or build the OutputHead of your own head."
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:
        scale /= float(config.logits_scaling)
    if getattr(config, "lm_head_multiplier", None) is not None:
        scale *= float(config.lm_head_multiplier)
    softcap = next(
        (getattr(config, name) for name in _SOFTCAPS if getattr(config, name, None) is not None), None
    )
    return OutputHead(embeddings.weight, getattr(embeddings, "bias", None), scale, softcap)
