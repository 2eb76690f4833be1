"""Hugging Face ``transformers`` models under context parallelism: ``attn_implementation="lightning_cp"``.

``import lightning_cp`` registers the attention implementation ``"lightning_cp"`` with ``transformers``
when it is installed (never importing it early: the registration happens when ``transformers`` loads
its attention and mask modules). A model built with it and called with the batch's shard
(``cp_shard=batch["cp_shard"]``, next to ``position_ids``) attends over whole sequences while each rank
holds its shard, and is plain ``"sdpa"`` attention otherwise (:mod:`lightning_cp.hf.attention`).
:func:`decoder` and :func:`output_head` are the two halves a training step uses (the body that gives the
hidden states, the head the loss applies); the strategies' setup refuses models that would train
differently under CP through the ``transformers`` integration (:mod:`lightning_cp.hf.integration`: static
checks, the token mixers' context-parallel forward, then a behavioural probe), and :func:`check_models` runs
those steps in one call outside a strategy (a script, a test);
:func:`load_balancing_loss` is a mixture-of-experts router loss of the whole global batch.

Token mixers that are not softmax attention (Gated DeltaNet, Kimi Delta Attention, Mamba2, short
convolutions: the hybrid models) get a head-parallel context-parallel forward at setup
(:mod:`lightning_cp.hf.mixers`).

:mod:`lightning_cp.hf.loading` builds pretrained models (shard by shard under FSDP) and
:mod:`lightning_cp.hf.export` writes trained ones back (:class:`ExportHFOnFitEnd` at the end of ``fit``).

No module here imports ``transformers`` when it is imported; it is an optional dependency
(``pip install lightning-cp[hf]``).
"""

from lightning_cp.constants import ATTN_IMPLEMENTATION
from lightning_cp.hf.attention import hf_context_parallel_attention
from lightning_cp.hf.causal_lm import decoder, output_head
from lightning_cp.hf.check import check_attention_is_context_parallel
from lightning_cp.hf.export import ExportHFOnFitEnd, export_hf
from lightning_cp.hf.integration import check_models
from lightning_cp.hf.loading import load_pretrained
from lightning_cp.hf.router_loss import load_balancing_loss

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ExportHFOnFitEnd",
    "check_attention_is_context_parallel",
    "check_models",
    "decoder",
    "export_hf",
    "hf_context_parallel_attention",
    "load_balancing_loss",
    "load_pretrained",
    "output_head",
]
