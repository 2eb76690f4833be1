"""A trained :class:`~lightning_cp.models.HFCausalLM` checkpoint back to a ``transformers`` directory.

:func:`export_hf` reads a Lightning checkpoint, a ``.ckpt`` file (``MegatronCPStrategy``) or a sharded
``torch.distributed.checkpoint`` folder (``MegatronCPFSDPStrategy``, written at any (dp, cp)), and writes
what ``save_pretrained`` writes: ``config.json``, ``generation_config.json``, ``model-*.safetensors`` shards
with their ``model.safetensors.index.json``, and the tokenizer files of the pretrained directory the run
started from. ``AutoModelForCausalLM.from_pretrained(output_dir)`` then gives the trained module's logits.
A run that started from a multimodal composite (Qwen3.5, Gemma-3, ...) exports the composite: its files with
the trained text weights in place and every other tower byte for byte as it was
(:mod:`lightning_cp.hf.composite`).

It runs in one process without a process group and never holds the model: the file is memory-mapped and
the folder read one tensor at a time (:mod:`lightning_cp.checkpoint_format`), so the peak is one
safetensors shard (``max_shard_bytes``). Everything is written into a hidden staging folder beside the
output and moved in when complete: a failure (a full disk, a bad tensor) leaves the output as it was. An
output that already holds weights (the pretrained directory, an earlier export) is refused unless
``overwrite=True``, which replaces its whole weight set (:func:`check_output_dir`).
:class:`ExportHFOnFitEnd` does it at the end of ``fit`` (rank 0, from a weights-only checkpoint every rank
writes into a hidden folder beside the output, removed after).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_cp.checkpoint_format import Checkpoint, open_checkpoint
from lightning_cp.hf.composite import StoredNames, is_composite, text_config
from lightning_cp.hf.loading import check_causal_lm_config
from lightning_cp.hf.lora_export import PretrainedBase, TrainedWeights, lora_of, write_adapter

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""The files of a ``transformers`` tokenizer directory that an export copies when the run had them."""

WEIGHT_FILES = (
    "model*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    "adapter_config.json",
    "adapter_model.safetensors",
)
"""The files ``from_pretrained`` reads weights from (patterns; a ``peft`` adapter's too, which ``transformers``
loads on its base in place of the directory's weights): what an output directory must not hold already unless
``overwrite=True``, and what an overwrite removes."""
_ENTRY_POINTS = (
    "adapter_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The weight files ``from_pretrained`` looks for first: while none is there, it loads nothing (and says so)."""


def export_hf(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    prefix: str = "model.",
    dtype: torch.dtype | None = None,
    tokenizer: str | Path | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    adapter: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Write the ``transformers`` model of a Lightning checkpoint as a ``save_pretrained`` directory.

    A checkpoint of a LoRA run (``HFCausalLM(lora=...)``) is written merged (each adapted weight
    ``W + (alpha / rank) B A``, computed in fp32, under the pretrained model's names); with ``adapter=True``
    as the ``peft`` adapter directory instead (:mod:`lightning_cp.hf.lora_export`), which
    ``PeftModel.from_pretrained(base, output_dir)`` loads on the pretrained base. Its frozen base is read from
    the pretrained directory the checkpoint names (or ``base``), checked against the checkpoint's fingerprint
    (:mod:`lightning_cp.hf.lora_checkpoint`); QLoRA's merged weights are its dequantized NF4 plus the update.

    Args:
        checkpoint: a ``.ckpt`` file, or a ``MegatronCPFSDPStrategy`` checkpoint folder, of a module whose
            ``hyper_parameters`` hold ``config`` (a ``save_pretrained`` directory or a config dict with
            ``model_type``), as :class:`~lightning_cp.models.HFCausalLM` saves them.
        output_dir: the directory to write (created; files of the same names are replaced, other files kept).
        prefix: the attribute path of the ``transformers`` model in the module's state dict.
        dtype: cast the trained weights to this dtype; ``None``: keep the checkpoint's (fp32 master weights
            stay fp32, a bf16 folder stays bf16). A composite's other towers always keep their stored dtype.
        tokenizer: a tokenizer directory whose files to copy; ``None``: those of the pretrained directory the
            run started from, if any.
        max_shard_bytes: the most bytes of one safetensors file.
        overwrite: replace the weights ``output_dir`` already holds (the pretrained directory, an earlier
            export): every file of :data:`WEIGHT_FILES` there is removed and the new set moved in, the files
            ``from_pretrained`` reads first last, so that no state in between loads a mix of the two.
        adapter: write a LoRA run's adapters alone (``adapter_config.json``, ``adapter_model.safetensors``) and
            the tokenizer files, not the merged model.
        base: the pretrained directory of a LoRA run's frozen base, where it is not (any more) at the path the
            checkpoint names (``None``: that path); also what ``adapter_config.json`` names as the base.

    Returns:
        ``output_dir``.

    Raises:
        ValueError: a checkpoint that is missing, unreadable, without a ``config`` hyperparameter, whose
            config is not a ``transformers`` causal LM's, or without parameters under ``prefix``; an
            ``output_dir`` that holds weights already without ``overwrite`` (:func:`check_output_dir`);
            ``adapter=True`` for a checkpoint of a run without LoRA; a merge that would change the model
            (:class:`~lightning_cp.hf.lora_export.TrainedWeights`); a ``base`` (or named base) that is not the
            one the checkpoint's adapters were trained on, or ``base`` for a checkpoint that names none.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(checkpoint)
    if not path.exists():
        raise ValueError(f"export_hf({str(path)!r}): no such checkpoint file or folder.")
    output = Path(output_dir)
    check_output_dir(output, overwrite)
    source = open_checkpoint(path)
    config, pretrained = _transformers_config(source, base)
    lora = lora_of(source)
    text = text_config(config)
    names = _stored_names(text)
    frozen = PretrainedBase.of(source, pretrained, config, names, given=base is not None)
    if adapter:
        if lora is None:
            raise ValueError(
                f"export_hf({str(checkpoint)!r}, adapter=True): the checkpoint is of a run without LoRA (its "
                "hyperparameter 'lora' is None): export the whole model (adapter=False)."
            )
        with _staged(output) as staging:
            write_adapter(source, lora, text_config(config), pretrained, staging, prefix, dtype)
            _copy_tokenizer(tokenizer if tokenizer is not None else pretrained, staging)
        return output
    tied = bool(getattr(text, "tie_word_embeddings", False))
    weights = TrainedWeights(source, prefix, lora, tied, frozen)
    shapes = {name: weights.shapes[name] for name in names if name in weights.shapes}
    missing = [name for name in names if name not in shapes]
    if missing:
        raise ValueError(
            f"export_hf({str(checkpoint)!r}): no {prefix}{missing[0]} (and {len(missing) - 1} more) in the "
            f"checkpoint; is prefix={prefix!r} where the module keeps its transformers model?"
        )
    with _staged(output) as staging:
        if pretrained is not None and is_composite(config):
            _export_composite(weights, pretrained, staging, names, dtype)
            _copy_tokenizer(tokenizer, staging)
            return output
        shards = _plan_shards(shapes, dtype, max_shard_bytes)
        weight_map = {}
        for index, shard in enumerate(shards, start=1):
            file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for name in shard:
                tensor = weights.read(name)
                tensors[name] = (tensor.to(dtype) if dtype is not None else tensor).contiguous()
                weight_map[name] = file
            save_file(tensors, staging / file, metadata={"format": "pt"})
        total = sum(_nbytes(shape, dtype) for shape in shapes.values())
        index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / "model.safetensors.index.json").write_text(
            json.dumps(index_file, indent=2, sort_keys=True)
        )
        config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
        config.dtype = dtype or next(iter(shapes.values()))[1]
        config.save_pretrained(staging)
        if pretrained is not None and (pretrained / "generation_config.json").is_file():
            shutil.copy(pretrained / "generation_config.json", staging)
        else:
            GenerationConfig.from_model_config(config).save_pretrained(staging)
        _copy_tokenizer(tokenizer if tokenizer is not None else pretrained, staging)
    return output


def check_output_dir(output_dir: str | Path, overwrite: bool) -> None:
    """Refuse an export into ``output_dir`` that could leave the old weights in force.

    A directory that already holds weight files (:data:`WEIGHT_FILES`: the pretrained directory, an earlier
    export) would keep them beside the new ones, and ``from_pretrained`` loads ``model.safetensors`` before
    an index: the old weights, silently. Without ``overwrite`` that is an error; with it the export replaces
    the whole set. No communication; reads the directory listing only.

    Raises:
        ValueError: ``output_dir`` is a file, or holds weight files and ``overwrite`` is false.
    """
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise ValueError(f"export_hf: output_dir {str(output)!r} is a file: give a directory.")
    held = _weight_files(output)
    if held and not overwrite:
        more = f" and {len(held) - 1} more weight file(s)" if len(held) > 1 else ""
        raise ValueError(
            f"export_hf: output_dir {str(output)!r} already holds {held[0]}{more} (a pretrained directory or an "
            f"earlier export), which from_pretrained would load instead of the new weights: give a new or empty "
            "directory, or overwrite=True (lightning-cp export-hf --overwrite) to replace them all."
        )


def _weight_files(directory: Path) -> list[str]:
    """The names of the files of :data:`WEIGHT_FILES` in ``directory``, those ``from_pretrained`` reads first
    first; none for a directory that does not exist."""
    if not directory.is_dir():
        return []
    names = {file.name for pattern in WEIGHT_FILES for file in directory.glob(pattern) if file.is_file()}
    return sorted(names, key=lambda name: (name not in _ENTRY_POINTS, name))


def _transformers_config(source: Checkpoint, base: str | Path | None) -> tuple[Any, Path | None]:
    """The ``transformers`` config of ``source``'s model (a composite's whole config), and the pretrained
    directory it came from (``base`` where given; ``None`` for a config dict).

    Raises:
        ValueError: no ``config`` hyperparameter, or one no ``AutoModelForCausalLM`` is built from (another
            kind of model's config, such as ``GPTModule``'s ``GPTConfig``), in one line.
    """
    from transformers import AutoConfig

    hparams = source.hyper_parameters
    where = f"export_hf({str(source.path)!r})"
    if "config" not in hparams:
        raise ValueError(
            f"{where}: the checkpoint's hyper_parameters have no 'config' (keys: {sorted(hparams)}); export a "
            "checkpoint of lightning_cp.models.HFCausalLM or of a module that saves its transformers config as "
            "hyperparameter 'config'."
        )
    value = hparams["config"]
    if not isinstance(value, str | Mapping):
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        raise ValueError(  # noqa: TRY004 - a checkpoint of another model: bad input, as the other cases
            f"{where}: the checkpoint's model is not a Hugging Face transformers model (its hyperparameter "
            f"'config' is a {kind}, not a pretrained directory or a dict with 'model_type'): export_hf writes "
            "checkpoints of lightning_cp.models.HFCausalLM, or of a module that saves its transformers config as "
            "hyperparameter 'config'."
        )
    if base is not None and isinstance(value, str):
        value = str(base)
    try:
        check_causal_lm_config(value)
    except ValueError as error:
        raise ValueError(
            f"{where}: the checkpoint's model config does not build a causal LM: {error}"
        ) from None
    if isinstance(value, str):
        return AutoConfig.from_pretrained(value, local_files_only=True), Path(value)
    return AutoConfig.for_model(**value), None


@contextmanager
def _staged(output: Path) -> Iterator[Path]:
    """A new hidden folder beside ``output`` (same filesystem) to write the export into, published into
    ``output`` when the block succeeds (:func:`_publish`) and removed when it fails."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.export-", dir=output.parent))
    try:
        yield staging
        _publish(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, output: Path) -> None:
    """Move every file of ``staging`` into ``output``, replacing the weight set there as one.

    A new ``output`` is the renamed ``staging``. Otherwise the old weight files go first, those
    ``from_pretrained`` reads first before the others, and the new files come in by ``os.replace`` (a rename
    on the same filesystem) in the reverse order: the other files, the shards, then the index or
    ``model.safetensors``. At no point does ``output`` hold an entry point with shards of another set.
    """
    if not output.exists():
        staging.rename(output)
        return
    for name in _weight_files(output):
        (output / name).unlink()
    weights = set(_weight_files(staging))
    incoming = sorted(
        staging.iterdir(), key=lambda file: (file.name in weights, file.name in _ENTRY_POINTS, file.name)
    )
    for file in incoming:
        os.replace(file, output / file.name)


def _copy_tokenizer(directory: str | Path | None, output: Path) -> None:
    for name in TOKENIZER_FILES:
        if directory is not None and (Path(directory) / name).is_file():
            shutil.copy(Path(directory) / name, output)


def _export_composite(
    weights: TrainedWeights, pretrained: Path, output: Path, trained: list[str], dtype: torch.dtype | None
) -> None:
    """The composite ``pretrained`` with its text model's tensors replaced by the trained ones.

    Every safetensors file of ``pretrained`` is written again under its name with every tensor it holds: the
    text model's (``trained``: text model names, stored under the composite's names, see
    :class:`~lightning_cp.hf.composite.StoredNames`) from ``weights`` (cast to ``dtype`` if given), the others
    (vision tower, projector, audio) as they were, byte for byte. Every other file of ``pretrained`` (the
    composite's config, generation config, processor and tokenizer files) is copied. One file in memory at a
    time.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    names = StoredNames(pretrained, composite=True)
    replace = {names(text): text for text in trained}
    sizes: dict[str, int] = {}
    for file in sorted(pretrained.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(file), "pt") as handle:
            metadata = handle.metadata()
            for key in list(handle.keys()):
                if key in replace:
                    tensor = weights.read(replace[key])
                    tensors[key] = (tensor.to(dtype) if dtype is not None else tensor).contiguous()
                else:
                    tensors[key] = handle.get_tensor(key)
                sizes[key] = tensors[key].numel() * tensors[key].element_size()
        save_file(tensors, output / file.name, metadata=metadata)
    missing = sorted(set(replace) - set(sizes))
    if missing:
        raise ValueError(f"export_hf: the composite in {pretrained} does not store {', '.join(missing[:5])}.")
    index = pretrained / "model.safetensors.index.json"
    if index.is_file():
        content = json.loads(index.read_text())
        content.setdefault("metadata", {})["total_size"] = sum(sizes.values())
        (output / index.name).write_text(json.dumps(content, indent=2, sort_keys=True))
    for file in pretrained.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != index.name:
            shutil.copy(file, output)


def _stored_names(config: Any) -> list[str]:
    """The names ``save_pretrained`` stores: every parameter and persistent buffer, tied ones once (the
    first name ``named_parameters`` gives, the input embedding for tied embeddings)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    persistent = set(model.state_dict())
    buffers = [name for name, _ in model.named_buffers() if name in persistent]
    return [name for name, _ in model.named_parameters()] + buffers


def _plan_shards(
    shapes: dict[str, tuple[torch.Size, torch.dtype]], dtype: torch.dtype | None, max_bytes: int
) -> list[list[str]]:
    """The names in ``shapes`` grouped, in order, into shards of at most ``max_bytes`` (a bigger tensor
    alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = _nbytes(shape, dtype)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _nbytes(shape: tuple[torch.Size, torch.dtype], dtype: torch.dtype | None) -> int:
    size, stored = shape
    return size.numel() * (dtype or stored).itemsize


class ExportHFOnFitEnd(Callback):
    """At the end of ``fit``, export the trained weights with :func:`export_hf` to ``output_dir``.

    Every rank writes its part of a checkpoint of the weights alone (``weights_only``: no optimizer state;
    a file under DDP, a folder under FSDP, no rank gathering the model) into a new hidden folder beside
    ``output_dir``; rank 0 exports it and removes the folder, while the others wait. Nothing but the export
    is left (for a checkpoint to resume from, add Lightning's ``ModelCheckpoint``), and no earlier run's
    files are in the way.

    Args:
        output_dir: the ``save_pretrained`` directory to write.
        dtype: as :func:`export_hf` (``"bfloat16"`` to halve an fp32 export), ``None``: the parameters'.
        tokenizer: as :func:`export_hf`.
        overwrite: as :func:`export_hf`: replace the weights ``output_dir`` holds (an earlier run's export).
        adapter: as :func:`export_hf`: a LoRA run's ``peft`` adapter directory (``adapter_config.json``,
            ``adapter_model.safetensors``) for ``PeftModel.from_pretrained(base, output_dir)``, not the merged
            model (``lightning-cp export-hf --adapter``).

    Raises:
        ValueError: when built, an ``output_dir`` that already holds weights without ``overwrite``
            (:func:`check_output_dir`); at setup, ``adapter=True`` for a module without LoRA adapters (its
            ``lora`` is ``None``): before training, not after it.

    Communication: a broadcast of the checkpoint folder's name, the checkpoint's collectives and the
    strategy's barrier.
    """

    def __init__(
        self,
        output_dir: str,
        dtype: str | None = None,
        tokenizer: str | None = None,
        overwrite: bool = False,
        adapter: bool = False,
    ) -> None:
        check_output_dir(output_dir, overwrite)
        self.output_dir = Path(output_dir)
        self.dtype = getattr(torch, dtype) if dtype else None
        self.tokenizer = tokenizer
        self.overwrite = overwrite
        self.adapter = adapter

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.adapter and getattr(pl_module, "lora", None) is None:
            raise ValueError(
                f"ExportHFOnFitEnd({str(self.output_dir)!r}, adapter=True): {type(pl_module).__name__} trains no "
                "LoRA adapters (its lora is None): export the whole model (adapter=False), or give it lora=."
            )

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = None
        if trainer.is_global_zero:
            self.output_dir.parent.mkdir(parents=True, exist_ok=True)
            folder = tempfile.mkdtemp(
                prefix=f".{self.output_dir.name}.checkpoint-", dir=self.output_dir.parent
            )
        folder = Path(trainer.strategy.broadcast(folder))
        try:
            checkpoint = folder / "weights.ckpt"
            trainer.save_checkpoint(checkpoint, weights_only=True)
            if trainer.is_global_zero:
                export_hf(
                    checkpoint,
                    self.output_dir,
                    dtype=self.dtype,
                    tokenizer=self.tokenizer,
                    overwrite=self.overwrite,
                    adapter=self.adapter,
                )
        finally:
            if trainer.is_global_zero:
                shutil.rmtree(folder, ignore_errors=True)
            trainer.strategy.barrier("export_hf")
