"""Reference models: a small GPT decoder and its LightningModule."""

from lightning_cp.models.gpt import GPT, GPTConfig
from lightning_cp.models.gpt_module import GPTModule

__all__ = ["GPT", "GPTConfig", "GPTModule"]
