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
safetensors shard (``max_shard_bytes``).
:class:`ExportHFOnFitEnd` does it at the end of ``fit`` (rank 0, after a checkpoint every rank writes).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_cp.checkpoint_format import Checkpoint, open_checkpoint
from lightning_cp.hf.composite import StoredNames, is_composite, text_config

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


def export_hf(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    prefix: str = "model.",
    dtype: torch.dtype | None = None,
    tokenizer: str | Path | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write the ``transformers`` model of a Lightning checkpoint as a ``save_pretrained`` directory.

    Args:
        checkpoint: a ``.ckpt`` file, or a ``MegatronCPFSDPStrategy`` checkpoint folder, of a module whose
            ``hyper_parameters`` hold ``config`` (a ``save_pretrained`` directory or a config dict with
            ``model_type``), as :class:`~lightning_cp.models.HFCausalLM` saves them.
        output_dir: the directory to write (created; files of the same names are replaced).
        prefix: the attribute path of the ``transformers`` model in the module's state dict.
        dtype: cast the weights to this dtype; ``None``: keep the checkpoint's (fp32 master weights stay fp32).
        tokenizer: a tokenizer directory whose files to copy; ``None``: those of the pretrained directory the
            run started from, if any.
        max_shard_bytes: the most bytes of one safetensors file.

    Returns:
        ``output_dir``.

    Raises:
        ValueError: a checkpoint without a ``config`` hyperparameter, or without parameters under ``prefix``.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(checkpoint)
    if not path.exists():
        raise ValueError(f"export_hf({str(path)!r}): no such checkpoint file or folder.")
    source = open_checkpoint(path)
    hparams = source.hyper_parameters
    if "config" not in hparams:
        raise ValueError(
            f"export_hf({str(checkpoint)!r}): the checkpoint's hyper_parameters have no 'config' (keys: "
            f"{sorted(hparams)}); export a checkpoint of lightning_cp.models.HFCausalLM or of a module that "
            "saves its transformers config as hyperparameter 'config'."
        )
    pretrained = Path(hparams["config"]) if isinstance(hparams["config"], str) else None
    if pretrained is not None:
        config = AutoConfig.from_pretrained(pretrained, local_files_only=True)
    else:
        config = AutoConfig.for_model(**hparams["config"])
    names = _stored_names(text_config(config))
    shapes = {name: source.shapes[prefix + name] for name in names if prefix + name in source.shapes}
    missing = [name for name in names if name not in shapes]
    if missing:
        raise ValueError(
            f"export_hf({str(checkpoint)!r}): no {prefix}{missing[0]} (and {len(missing) - 1} more) in the "
            f"checkpoint; is prefix={prefix!r} where the module keeps its transformers model?"
        )
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    if pretrained is not None and is_composite(config):
        _export_composite(source, pretrained, output, {prefix + n: n for n in names}, dtype)
        _copy_tokenizer(tokenizer, output)
        return output
    shards = _plan_shards(shapes, dtype, max_shard_bytes)
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in shard:
            tensor = source.read(prefix + name)
            tensors[name] = (tensor.to(dtype) if dtype is not None else tensor).contiguous()
            weight_map[name] = file
        save_file(tensors, output / file, metadata={"format": "pt"})
    total = sum(_nbytes(shape, dtype) for shape in shapes.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (output / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2, sort_keys=True))
    config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
    config.dtype = dtype or next(iter(shapes.values()))[1]
    config.save_pretrained(output)
    if pretrained is not None and (pretrained / "generation_config.json").is_file():
        shutil.copy(pretrained / "generation_config.json", output)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(output)
    _copy_tokenizer(tokenizer if tokenizer is not None else pretrained, output)
    return output


def _copy_tokenizer(directory: str | Path | None, output: Path) -> None:
    for name in TOKENIZER_FILES:
        if directory is not None and (Path(directory) / name).is_file():
            shutil.copy(Path(directory) / name, output)


def _export_composite(
    source: Checkpoint, pretrained: Path, output: Path, trained: dict[str, str], dtype: torch.dtype | None
) -> None:
    """The composite ``pretrained`` with its text model's tensors replaced by the trained ones.

    Every safetensors file of ``pretrained`` is written again under its name with every tensor it holds: the
    text model's (``trained``: checkpoint name -> text model name, stored under the composite's name, see
    :class:`~lightning_cp.hf.composite.StoredNames`) from ``source`` (cast to ``dtype`` if given), the others
    (vision tower, projector, audio) as they were, byte for byte. Every other file of ``pretrained`` (the
    composite's config, generation config, processor and tokenizer files) is copied. One file in memory at a
    time.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    names = StoredNames(pretrained, composite=True)
    replace = {names(text): checkpoint for checkpoint, text in trained.items()}
    sizes: dict[str, int] = {}
    for file in sorted(pretrained.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(file), "pt") as handle:
            metadata = handle.metadata()
            for key in list(handle.keys()):
                if key in replace:
                    tensor = source.read(replace[key])
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
    """At the end of ``fit``, save a checkpoint and export it with :func:`export_hf` to ``output_dir``.

    Every rank writes its part of the checkpoint ``<output_dir>.ckpt`` (a file under DDP, a folder under
    FSDP, no rank gathering the model); rank 0 then exports it while the others wait.

    Args:
        output_dir: the ``save_pretrained`` directory to write.
        dtype: as :func:`export_hf` (``"bfloat16"`` to halve an fp32 export), ``None``: the parameters'.
        tokenizer: as :func:`export_hf`.

    Communication: the checkpoint's collectives and the strategy's barrier.
    """

    def __init__(self, output_dir: str, dtype: str | None = None, tokenizer: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.dtype = getattr(torch, dtype) if dtype else None
        self.tokenizer = tokenizer

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        checkpoint = self.output_dir.with_name(self.output_dir.name + ".ckpt")
        trainer.save_checkpoint(checkpoint)
        if trainer.is_global_zero:
            export_hf(checkpoint, self.output_dir, dtype=self.dtype, tokenizer=self.tokenizer)
        trainer.strategy.barrier("export_hf")
