"""``HFCausalLM``: a Hugging Face ``transformers`` causal LM trained with the CP-local fused loss."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_cp.constants import (
    ATTN_IMPLEMENTATION,
    CP_SHARD,
    INPUT_IDS,
    INPUT_MASK,
    POSITION_IDS,
    REF_LOGPROBS,
)
from lightning_cp.hf.causal_lm import decoder, output_head
from lightning_cp.hf.export import ExportHFOnFitEnd
from lightning_cp.hf.loading import causal_lm_config, check_causal_lm_config, load_pretrained
from lightning_cp.hf.lora import LoRA, adapters_off, add_adapters, require_peft
from lightning_cp.hf.lora_checkpoint import base_record, check_base, keep_adapters_only
from lightning_cp.hf.qlora import require_torchao
from lightning_cp.hf.registration import UnsupportedAttentionClasses
from lightning_cp.hf.router_loss import load_balancing_loss
from lightning_cp.loss import CPLossMixin, PolicyObjective
from lightning_cp.memory import tile_model
from lightning_cp.parallel.layout import current_layout


class HFCausalLM(CPLossMixin, LightningModule):
    """A ``transformers`` ``AutoModelForCausalLM`` ready for :class:`~lightning_cp.MegatronCPStrategy`.

    The model is built in ``configure_model`` with ``attn_implementation="lightning_cp"``, so its
    attention reaches across CP ranks (grouped-query attention gathers only the key/value heads) and
    packed documents stay apart. The step runs the decoder body (:func:`lightning_cp.hf.decoder`: the
    model's own ``get_decoder()``) on the batch's ``input_ids``, ``position_ids`` and ``cp_shard`` (which
    the attention layers receive as a keyword argument) and gives the last hidden states and the output
    head (:func:`lightning_cp.hf.output_head`: weight, bias, logit scale, final softcap) to
    :meth:`~lightning_cp.CPLossMixin.lm_loss`: no ``[tokens, vocab]`` logits are materialized, tied
    embeddings included. A mixture-of-experts model adds its router load-balancing loss of the global
    batch (:func:`lightning_cp.hf.load_balancing_loss`) as ``transformers`` adds it to its ``labels=`` loss.
    A family whose attention classes cannot run ``"lightning_cp"`` at all (Falcon, GPT-J) is built with its
    default attention; the strategy refuses it under ``cp > 1`` with the reason, at setup.

    Args:
        config: either a ``transformers`` config as a dict with its ``model_type`` (``{"model_type":
            "qwen3", "hidden_size": 1024, ...}``: a randomly initialized model), or the path of a local
            directory written by ``save_pretrained`` (``config.json`` and safetensors weights; nothing is
            downloaded), loaded by :func:`~lightning_cp.load_pretrained`: under
            :class:`~lightning_cp.MegatronCPFSDPStrategy` each rank reads only its own shards. A multimodal
            composite (Qwen3.5, Gemma-3, Gemma-4, Llama-4; directory or dict) trains its text model only
            (:mod:`lightning_cp.hf.composite`).
        dtype: parameter dtype of the model; ``None``: the one ``Trainer(precision=...)`` sets while
            ``configure_model`` runs (``bfloat16`` for ``"bf16-true"``, ``float32`` for ``"32-true"`` and
            the fp32 master weights of ``"bf16-mixed"``). Pretrained weights are cast tensor by tensor.
        gradient_checkpointing: recompute every decoder layer in the backward (``transformers``' own,
            non-reentrant), trading compute for activation memory.
        tiled: run the dense MLPs, the norms and a mixture of experts' experts over sequence tiles, saving
            only their inputs, and let the projections that read a norm recompute its output instead of
            saving it (:func:`~lightning_cp.memory.tile_model`; exact, the router and its load-balancing
            loss untiled): the ``+tiled`` of ``lightning-cp plan``. Experts whose routing the tiling does not
            know (Llama-4's) are refused when the model is built.
        lr: peak AdamW learning rate.
        betas: AdamW betas.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up from 0 to ``lr`` over this many optimizer steps (0: none).
        chunk_size: tokens per chunk of the fused loss (``None``: automatic).
        router_aux_loss_coef: weight of the mixture-of-experts load-balancing loss; ``None`` follows the
            model as ``transformers`` does (its ``router_aux_loss_coef`` when the config sets
            ``output_router_logits``, else none), ``0`` turns it off.
        objective: ``None``: the language-modeling loss; a :class:`~lightning_cp.PolicyObjective`: the steps
            train (and evaluate) that reinforcement-learning objective on rollout batches
            (:meth:`~lightning_cp.CPLossMixin.policy_loss`, :class:`~lightning_cp.data.RolloutDataModule`), and
            ``predict`` gives the log-probs at its sampling temperature.
        lora: ``None``: full fine-tuning; a :class:`~lightning_cp.hf.lora.LoRA` (or its fields' dict): ``peft``
            LoRA adapters on the built or loaded model (:func:`~lightning_cp.hf.lora.add_adapters`, before the
            checkpointing and the tiling), the base frozen in ``dtype`` and only the adapters trained and given
            to AdamW; with ``quantize="nf4"`` (QLoRA) the decoder's linear weights stored as 4-bit NF4,
            quantized as they load (:mod:`lightning_cp.hf.qlora`). Both strategies, any dp x cp. With an
            ``objective`` whose ``kl_coef > 0`` on rollouts without ``ref_logprobs``, the reference policy is
            the base model, adapters off, its log-probs computed in the step (one forward without a graph).
            Checkpoints hold the adapters and their optimizer state and name the pretrained base, which a resume
            rebuilds and checks (:meth:`on_save_checkpoint`, :mod:`lightning_cp.hf.lora_checkpoint`).

    Raises:
        ImportError: ``transformers`` is not installed (``pip install 'lightning-cp[hf]'``); ``lora`` without
            ``peft``, or NF4 without ``torchao`` (``pip install 'lightning-cp[lora]'``).
        ValueError: a config ``transformers`` cannot build a causal LM from (see
            :func:`~lightning_cp.hf.loading.check_causal_lm_config`): a dict without ``model_type``, an
            unknown ``model_type`` or one without a causal-LM class, values its ``transformers`` config class
            rejects, head counts that do not divide, a path that is not a directory or lacks ``config.json``
            or safetensors weights. The CLI reports it as one line, before any process starts.
    """

    def __init__(
        self,
        config: dict[str, Any] | str,
        dtype: Literal["float32", "bfloat16", "float16"] | None = None,
        gradient_checkpointing: bool = False,
        tiled: bool = False,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        chunk_size: int | None = None,
        router_aux_loss_coef: float | None = None,
        objective: PolicyObjective | None = None,
        lora: LoRA | None = None,
    ) -> None:
        if importlib.util.find_spec("transformers") is None:
            raise ImportError("HFCausalLM needs transformers: pip install 'lightning-cp[hf]'.")
        check_causal_lm_config(config)
        super().__init__()
        self.save_hyperparameters()
        # Under LightningCLI (and from a checkpoint's hyperparameters) the objective is its fields' dict.
        self.objective = PolicyObjective(**objective) if isinstance(objective, Mapping) else objective
        self.lora = LoRA.of(lora)
        if self.lora is not None:
            require_peft()
            if self.lora.quantize == "nf4":
                require_torchao()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        """Build the ``transformers`` model (once; Lightning calls this after the processes are set up).

        A directory is loaded by :func:`~lightning_cp.load_pretrained` (on the meta device under the FSDP
        strategy, which then reads each rank's shards); a config dict is a random initialization. LoRA
        adapters go in before the checkpointing and the tiling wrap the layers they are in.
        """
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        config = self.hparams.config
        dtype = getattr(torch, self.hparams.dtype) if self.hparams.dtype else torch.get_default_dtype()
        if isinstance(config, str):

            def build(**kwargs: Any) -> torch.nn.Module:
                return load_pretrained(config, dtype=dtype, **kwargs)
        else:

            def build(**kwargs: Any) -> torch.nn.Module:
                return AutoModelForCausalLM.from_config(causal_lm_config(config), dtype=dtype, **kwargs)

        try:
            model = build(attn_implementation=ATTN_IMPLEMENTATION)
        except UnsupportedAttentionClasses:
            # Attention classes of its own (Falcon): the family's default, which the strategy refuses under CP.
            model = build(attn_implementation=None)
        if self.lora is not None:
            model = add_adapters(model, self.lora)
        if self.hparams.gradient_checkpointing:
            options = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # the newer name of the same switch
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        if self.hparams.tiled:
            tile_model(model)
        self.model = model

    def forward(self, batch: dict[str, Any]) -> Tensor:
        """Last hidden states ``[B, S_local, hidden_size]`` of this rank's tokens of a sharded batch."""
        return self._decode(batch, router_logits=False).last_hidden_state

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """The loss of this rank's shard (:meth:`~lightning_cp.CPLossMixin.lm_loss`, or
        :meth:`~lightning_cp.CPLossMixin.policy_loss` with an ``objective``), plus the router
        load-balancing loss of the global batch for a mixture-of-experts model; also the val / test step."""
        coefficient = self._router_aux_loss_coef()
        out = self._decode(batch, router_logits=bool(coefficient))
        objective = self.objective
        if objective is None:
            loss = self.lm_loss(
                out.last_hidden_state, output_head(self.model), batch, chunk_size=self.hparams.chunk_size
            )
        else:
            if self.lora is not None and objective.kl_coef > 0 and REF_LOGPROBS not in batch:
                batch = {**batch, REF_LOGPROBS: self._reference_logprobs(batch)}
            loss = self.policy_loss(
                out.last_hidden_state,
                output_head(self.model),
                batch,
                objective,
                chunk_size=self.hparams.chunk_size,
            )
        if coefficient:
            aux = load_balancing_loss(
                out.router_logits,
                self.model.num_experts,
                self.model.num_experts_per_tok,
                batch[INPUT_MASK],
                current_layout().loss_group,
            )
            loss = loss + coefficient * self.global_aux_loss(aux)
        return loss

    validation_step = training_step
    test_step = training_step

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Log-probability of every next token of this rank's shard (0 where there is no target), at the
        ``objective``'s temperature when there is one."""
        temperature = 1.0 if self.objective is None else self.objective.temperature
        return self.lm_token_logprobs(self(batch), output_head(self.model), batch, temperature=temperature)

    def _reference_logprobs(self, batch: dict[str, Any]) -> Tensor:
        """The reference policy's log-probs of this rank's targets ``[B, S_local]`` at the objective's
        temperature: with LoRA the base model, adapters off (:func:`~lightning_cp.hf.lora.adapters_off`),
        one forward without a graph in the step itself (no second model, no ``predict`` pass). Under FSDP it
        gathers the parameters once more; under CP it communicates as the step's forward does."""
        with torch.no_grad(), adapters_off(self.model):
            hidden = self._decode(batch, router_logits=False).last_hidden_state
            found = self.lm_token_logprobs(
                hidden, output_head(self.model), batch, temperature=self.objective.temperature
            )
        return found["logprobs"]

    def _decode(self, batch: dict[str, Any], *, router_logits: bool) -> Any:
        extra = {"output_router_logits": True} if router_logits else {}
        return decoder(self.model)(
            input_ids=batch[INPUT_IDS],
            position_ids=batch[POSITION_IDS],
            cp_shard=batch.get(CP_SHARD),
            use_cache=False,
            **extra,
        )

    def _router_aux_loss_coef(self) -> float:
        """The load-balancing loss weight: the hyperparameter, or the model's own as ``transformers`` uses it."""
        coefficient = self.hparams.router_aux_loss_coef
        if coefficient is None:
            follows = getattr(self.model.config, "output_router_logits", False)
            coefficient = getattr(self.model, "router_aux_loss_coef", 0.0) if follows else 0.0
        if coefficient and not hasattr(self.model, "num_experts_per_tok"):
            raise ValueError(
                f"HFCausalLM(router_aux_loss_coef={coefficient}): {type(self.model).__name__} is not a "
                "mixture-of-experts model with a router load-balancing loss (no num_experts_per_tok); set "
                "router_aux_loss_coef=0."
            )
        return float(coefficient)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW over the parameters that require a gradient (with LoRA: the adapters only), with the warm-up."""
        hparams = self.hparams
        trained = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            trained, lr=hparams.lr, betas=tuple(hparams.betas), weight_decay=hparams.weight_decay
        )
        warmup = max(1, hparams.warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def setup(self, stage: str) -> None:
        """Refuse, before the first step, a fit that would save a checkpoint (a ``ModelCheckpoint``, as
        ``Trainer`` adds by default, or :class:`~lightning_cp.hf.export.ExportHFOnFitEnd`) that
        :meth:`on_save_checkpoint` would refuse."""
        saves = bool(self.trainer.checkpoint_callbacks) or any(
            isinstance(callback, ExportHFOnFitEnd) for callback in self.trainer.callbacks
        )
        if stage == "fit" and saves:
            self._refuse_unnamed_quantized_base()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """With LoRA on a pretrained directory, keep the adapters alone in the checkpoint's module state (their
        AdamW state is all the optimizer holds) and name the frozen base instead of saving it
        (:data:`~lightning_cp.checkpoint_format.FROZEN_BASE`, :mod:`lightning_cp.hf.lora_checkpoint`): a resume
        rebuilds it from the directory and checks it first (:meth:`check_frozen_base`). LoRA on a config dict
        (a random base, which nothing else names) saves the base too. Every rank, no communication.

        Raises:
            ValueError: QLoRA on a config dict: its NF4 base could be neither saved nor rebuilt.
        """
        if self.lora is None:
            return
        self._refuse_unnamed_quantized_base()
        if isinstance(self.hparams.config, str):
            keep_adapters_only(checkpoint, self._base_record())

    def check_frozen_base(self, record: Mapping[str, Any], checkpoint: Path) -> None:
        """Before the strategy loads ``checkpoint``, a checkpoint of the adapters alone whose frozen base is
        ``record`` (:meth:`on_save_checkpoint`): refuse it unless this module's base, rebuilt from its pretrained
        directory, is that base (:func:`~lightning_cp.hf.lora_checkpoint.check_base`). Reads the directory's
        safetensors headers and a few rows; no communication.

        Raises:
            ValueError: this module has no LoRA, or a config dict for a base, or another base.
        """
        where = f"HFCausalLM: the checkpoint {str(checkpoint)!r} holds LoRA adapters trained on "
        where += repr(record["pretrained"])
        if self.lora is None or not isinstance(self.hparams.config, str):
            missing = (
                "lora=None" if self.lora is None else "a config dict for a base (a random initialization)"
            )
            raise ValueError(
                f"{where}, and this module has {missing}: build it as the run was, HFCausalLM(config="
                f"{record['pretrained']!r}, lora=...)."
            )
        check_base(record, self._base_record(), checkpoint, "HFCausalLM")

    def _base_record(self) -> dict[str, Any]:
        """What names this module's frozen base (:func:`~lightning_cp.hf.lora_checkpoint.base_record`)."""
        dtype = self.model.get_input_embeddings().weight.dtype
        return base_record(Path(self.hparams.config), dtype, self.lora)

    def _refuse_unnamed_quantized_base(self) -> None:
        if (
            self.lora is not None
            and self.lora.quantize is not None
            and not isinstance(self.hparams.config, str)
        ):
            raise ValueError(
                f"HFCausalLM(lora=LoRA(quantize={self.lora.quantize!r})) on a config dict: its checkpoints would "
                "need the randomly initialized NF4 base, which they do not hold (a QLoRA checkpoint holds the "
                "adapters and names the pretrained directory its base is quantized from again). Train from a "
                "pretrained directory (save_pretrained the model first), or without checkpoints (no "
                "ModelCheckpoint: Trainer(enable_checkpointing=False), no ExportHFOnFitEnd)."
            )
