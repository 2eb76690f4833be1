"""Reference models: a small GPT decoder and its LightningModule, and Hugging Face causal LMs.

:class:`HFCausalLM` imports ``transformers`` only when it builds its model (an optional dependency).
"""

from lightning_cp.models.gpt import GPT, GPTConfig
from lightning_cp.models.gpt_module import GPTModule
from lightning_cp.models.hf_causal_lm import HFCausalLM

__all__ = ["GPT", "GPTConfig", "GPTModule", "HFCausalLM"]
