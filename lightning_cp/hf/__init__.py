"""Hugging Face ``transformers`` models under context parallelism: ``attn_implementation="lightning_cp"``.

``import lightning_cp`` registers the attention implementation ``"lightning_cp"`` with ``transformers``
when it is installed (never importing it early: the registration happens when ``transformers`` loads
its attention and mask modules). A model built with it and called with the batch's shard
(``cp_shard=batch["cp_shard"]``, next to ``position_ids``) attends over whole sequences while each rank
holds its shard, and is plain ``"sdpa"`` attention otherwise (:mod:`lightning_cp.hf.attention`);
:func:`check_attention_is_context_parallel` is the strategy's guard against models that would attend
only within a shard.

:mod:`lightning_cp.hf.loading` builds pretrained models (shard by shard under FSDP) and
:mod:`lightning_cp.hf.export` writes trained ones back (:class:`ExportHFOnFitEnd` at the end of ``fit``).

No module here imports ``transformers`` when it is imported; it is an optional dependency
(``pip install lightning-cp[hf]``).
"""

from lightning_cp.hf.attention import ATTN_IMPLEMENTATION, hf_context_parallel_attention
from lightning_cp.hf.check import check_attention_is_context_parallel
from lightning_cp.hf.export import ExportHFOnFitEnd, export_hf
from lightning_cp.hf.loading import load_pretrained

__all__ = [
    "ATTN_IMPLEMENTATION",
    "ExportHFOnFitEnd",
    "check_attention_is_context_parallel",
    "export_hf",
    "hf_context_parallel_attention",
    "load_pretrained",
]
