"""``HFCausalLM``: a Hugging Face ``transformers`` causal LM trained with the CP-local fused loss."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_cp.constants import CP_SHARD, INPUT_IDS, POSITION_IDS
from lightning_cp.hf.attention import ATTN_IMPLEMENTATION
from lightning_cp.hf.loading import check_causal_lm_config, load_pretrained
from lightning_cp.loss import CPLossMixin


class HFCausalLM(CPLossMixin, LightningModule):
    """A ``transformers`` ``AutoModelForCausalLM`` ready for :class:`~lightning_cp.MegatronCPStrategy`.

    The model is built in ``configure_model`` with ``attn_implementation="lightning_cp"``, so its
    attention reaches across CP ranks (grouped-query attention gathers only the key/value heads) and
    packed documents stay apart. The step runs the decoder (``self.model.model``) on the batch's
    ``input_ids``, ``position_ids`` and ``cp_shard`` (which the attention layers receive as a keyword
    argument) and gives the last hidden states and the LM-head weight to
    :meth:`~lightning_cp.CPLossMixin.lm_loss`: no ``[tokens, vocab]`` logits are materialized, tied
    embeddings included.

    Args:
        config: either a ``transformers`` config as a dict with its ``model_type`` (``{"model_type":
            "qwen3", "hidden_size": 1024, ...}``: a randomly initialized model), or the path of a local
            directory written by ``save_pretrained`` (``config.json`` and safetensors weights; nothing is
            downloaded), loaded by :func:`~lightning_cp.load_pretrained`: under
            :class:`~lightning_cp.MegatronCPFSDPStrategy` each rank reads only its own shards.
        dtype: parameter dtype of the model; ``None``: the one ``Trainer(precision=...)`` sets while
            ``configure_model`` runs (``bfloat16`` for ``"bf16-true"``, ``float32`` for ``"32-true"`` and
            the fp32 master weights of ``"bf16-mixed"``). Pretrained weights are cast tensor by tensor.
        gradient_checkpointing: recompute every decoder layer in the backward (``transformers``' own,
            non-reentrant), trading compute for activation memory.
        lr: peak AdamW learning rate.
        betas: AdamW betas.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up from 0 to ``lr`` over this many optimizer steps (0: none).
        chunk_size: tokens per chunk of the fused loss (``None``: automatic).

    Raises:
        ImportError: ``transformers`` is not installed (``pip install 'lightning-cp[hf]'``).
        ValueError: a config ``transformers`` cannot build a causal LM from (see
            :func:`~lightning_cp.hf.loading.check_causal_lm_config`): a dict without ``model_type``, an
            unknown ``model_type`` or one without a causal-LM class, a path that is not a directory or lacks
            ``config.json`` or safetensors weights. The CLI reports it as one line, before any process starts.
    """

    def __init__(
        self,
        config: dict[str, Any] | str,
        dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        gradient_checkpointing: bool = False,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        chunk_size: int | None = None,
    ) -> None:
        if importlib.util.find_spec("transformers") is None:
            raise ImportError("HFCausalLM needs transformers: pip install 'lightning-cp[hf]'.")
        check_causal_lm_config(config)
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        """Build the ``transformers`` model (once; Lightning calls this after the processes are set up).

        A directory is loaded by :func:`~lightning_cp.load_pretrained` (on the meta device under the FSDP
        strategy, which then reads each rank's shards); a config dict is a random initialization.
        """
        if self.model is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        config = self.hparams.config
        dtype = getattr(torch, self.hparams.dtype) if self.hparams.dtype else torch.get_default_dtype()
        if isinstance(config, str):
            model = load_pretrained(config, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(**config), attn_implementation=ATTN_IMPLEMENTATION, dtype=dtype
            )
        if self.hparams.gradient_checkpointing:
            options = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # the newer name of the same switch
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        self.model = model

    def forward(self, batch: dict[str, Any]) -> Tensor:
        """Last hidden states ``[B, S_local, hidden_size]`` of this rank's tokens of a sharded batch."""
        out = self.model.model(
            input_ids=batch[INPUT_IDS],
            position_ids=batch[POSITION_IDS],
            cp_shard=batch.get(CP_SHARD),
            use_cache=False,
        )
        return out.last_hidden_state

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """The loss of this rank's shard (:meth:`~lightning_cp.CPLossMixin.lm_loss`); also the val / test step."""
        weight = self.model.get_output_embeddings().weight
        return self.lm_loss(self(batch), weight, batch, chunk_size=self.hparams.chunk_size)

    validation_step = training_step
    test_step = training_step

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Log-probability of every next token of this rank's shard (0 where there is no target)."""
        return self.lm_token_logprobs(self(batch), self.model.get_output_embeddings().weight, batch)

    def configure_optimizers(self) -> dict[str, Any]:
        hparams = self.hparams
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=hparams.lr, betas=tuple(hparams.betas), weight_decay=hparams.weight_decay
        )
        warmup = max(1, hparams.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
