"""Pretrained ``transformers`` causal LMs from a local directory: checked early, loaded whole or shard by shard.

:func:`load_pretrained` is the one way to build a pretrained model in ``configure_model``
(:class:`~lightning_cp.models.HFCausalLM` uses it, and so can a user's own module). What it does depends
on the strategy that calls ``configure_model``:

- under :class:`~lightning_cp.MegatronCPFSDPStrategy` (which enters :func:`deferred_loading`), the model is
  built with its parameters on the ``meta`` device (no memory) and its buffers computed as usual (rotary
  ``inv_freq`` and the like, which no checkpoint holds); the strategy shards it with ``fully_shard``, then
  :func:`materialize_pretrained` allocates each rank's local shards only and fills them from the
  checkpoint's safetensors with ``torch.distributed.checkpoint``'s ``HuggingFaceStorageReader``, which
  reads just the slices a rank owns. Each process's peak host memory is its shard plus one slice;
- otherwise (DDP, one device, no strategy) ``transformers``' ``from_pretrained`` loads the whole model once
  per process, in the target dtype.

A multimodal composite directory (Qwen3.5, Gemma-3, Gemma-4, Llama-4: a ``text_config`` beside a
``vision_config``) gives its text causal LM, read from the composite's files under their stored names
(:mod:`lightning_cp.hf.composite`), whole or shard by shard as above; the other towers are not loaded.

The dtype is the one asked for, else ``torch.get_default_dtype()`` inside ``configure_model``, which
Lightning sets from ``Trainer(precision=...)``: ``bfloat16`` for ``"bf16-true"``, ``float32`` for
``"32-true"`` and the ``-mixed`` precisions (their fp32 master weights). A checkpoint in another dtype is
cast tensor by tensor as it is read; no copy of the whole model in another dtype is made.

:func:`check_causal_lm_config` is the check ``HFCausalLM`` runs at construction, before any process starts.
"""

from __future__ import annotations

import difflib
import importlib
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_cp.constants import ATTN_IMPLEMENTATION
from lightning_cp.hf.composite import StoredNames, is_composite, text_config
from lightning_cp.hf.lora import stored_name
from lightning_cp.hf.sparse_kinds import REFUSED as INDEXER_REFUSALS

_PRETRAINED_SOURCE = "_lightning_cp_pretrained"
"""Attribute of a model built on the meta device: the directory whose weights fill it after sharding, and
where they are stored in it (:class:`~lightning_cp.hf.composite.StoredNames`)."""

_deferring: ContextVar[bool] = ContextVar("lightning_cp_deferred_loading", default=False)


@contextmanager
def deferred_loading() -> Iterator[None]:
    """Inside: :func:`load_pretrained` builds on the meta device and leaves the weights to
    :func:`materialize_pretrained` (the FSDP strategy enters this around ``configure_model``)."""
    token = _deferring.set(True)
    try:
        yield
    finally:
        _deferring.reset(token)


def check_causal_lm_config(config: Mapping[str, Any] | str, owner: str = "HFCausalLM") -> None:
    """Raise a one-line ``ValueError`` for a config no ``AutoModelForCausalLM`` can be built from.

    Args:
        config: a ``transformers`` config as a dict with its ``model_type``, or a local directory written by
            ``save_pretrained`` (``config.json`` and ``*.safetensors`` weights).
        owner: the name that starts the message (``HFCausalLM(config=...)``).

    Raises:
        ValueError: a path that is not a directory, a directory without ``config.json`` or without
            safetensors weights, a safetensors file cut short (or longer than its header says) or named by
            the index but absent (from the files' headers and sizes), a dict without ``model_type``, a ``model_type`` ``transformers`` does not
            know (with the closest known names), or one without a causal-LM class, a config its
            ``transformers`` config class rejects, or head counts that do not divide.
    """
    directory = None
    if isinstance(config, str):
        directory, config = Path(config), _read_directory_config(config, owner)
    elif "model_type" not in config:
        raise ValueError(
            f"{owner}(config=...): the dict has no 'model_type' (keys: {sorted(config)}); add the "
            "transformers model type, e.g. model_type: qwen3 or model_type: llama."
        )
    _check_model_type(config["model_type"], owner)
    _check_transformers_accepts(config, owner)
    if directory is not None:
        _check_safetensors_files(directory, owner)


def causal_lm_config(config: Mapping[str, Any] | str) -> Any:
    """The ``transformers`` config of the causal LM a config dict or a ``save_pretrained`` directory builds: its
    own, or a composite's text config (:mod:`lightning_cp.hf.composite`). A directory's ``config.json`` is all
    that is read."""
    from transformers import AutoConfig

    if isinstance(config, str):
        return text_config(AutoConfig.from_pretrained(config, local_files_only=True))
    return text_config(AutoConfig.for_model(**config))


def _read_directory_config(path: str, owner: str) -> dict[str, Any]:
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(
            f"{owner}(config={path!r}): not a local directory. Give the directory of a model saved with "
            "save_pretrained (nothing is downloaded), or a config dict with a model_type."
        )
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{owner}(config={path!r}): the directory has no config.json; give a directory written by "
            "save_pretrained (config.json and *.safetensors)."
        )
    if not any(directory.glob("*.safetensors")):
        found = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = (
            f" It has {', '.join(found)}: rewrite it as safetensors with "
            f"AutoModelForCausalLM.from_pretrained({path!r}).save_pretrained(<new directory>)."
            if found
            else ""
        )
        raise ValueError(f"{owner}(config={path!r}): the directory has no *.safetensors weights.{hint}")
    config = json.loads(config_file.read_text())
    if "model_type" not in config:
        raise ValueError(f"{owner}(config={path!r}): {config_file} has no 'model_type'.")
    return config


def _check_safetensors_files(directory: Path, owner: str) -> None:
    """Every ``*.safetensors`` file of ``directory`` whole, and every file its index names present: read from
    each file's header (its first bytes) and size, no tensor is read. A file cut short by an interrupted copy
    otherwise fails only in the ranks, deep inside the loading, without its name."""
    where = f"{owner}(config={str(directory)!r})"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            named = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError) as error:
            raise ValueError(
                f"{where}: {index.name} is not a safetensors index ({type(error).__name__}: {error}): copy it "
                "again from the model's source."
            ) from None
        missing = sorted(name for name in named if not (directory / name).is_file())
        if missing:
            raise ValueError(
                f"{where}: {index.name} names {', '.join(missing)}, which the directory lacks: copy the missing "
                "files from the model's source."
            )
    for file in sorted(directory.glob("*.safetensors")):
        problem = _safetensors_problem(file)
        if problem is not None:
            raise ValueError(f"{where}: {file.name} {problem}: copy it again from the model's source.")


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with the safetensors file ``file`` as its header describes it, or ``None``. The format: an
    8-byte little-endian header length ``n``, ``n`` bytes of JSON giving each tensor's ``data_offsets`` into
    the data that follows, and nothing after the last tensor."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        length = int.from_bytes(handle.read(8), "little") if size >= 8 else None
        if length is None or 8 + length > size:
            announced = "" if length is None else f" (its first 8 bytes announce a {length}-byte header)"
            return f"is {size} bytes, shorter than its header{announced}: the file is truncated, or not safetensors"
        try:
            header = json.loads(handle.read(length))
            ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "does not start with a safetensors header (not a safetensors file, or damaged)"
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"is {size} bytes, but its header describes {expected}: the file is truncated"
    if size > expected:
        return f"is {size} bytes, but its header describes {expected}: the file is damaged"
    return None


def _check_model_type(model_type: str, owner: str) -> None:
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING_NAMES), n=3)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"{owner}(config=...): model_type {model_type!r} is not a model type of transformers "
            f"{__version__}.{hint}"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{owner}(config=...): model_type {model_type!r} has no causal-LM class in transformers "
            f"{__version__} (AutoModelForCausalLM does not build it){_refused_indexer(model_type)}; use a "
            "decoder model such as llama, qwen3 or mistral."
        )


def _refused_indexer(model_type: str) -> str:
    """For a family whose modeling module defines a sparse-attention indexer CP does not compute
    (:data:`~lightning_cp.hf.sparse_kinds.REFUSED`: GLM-5-Next, Mistral-Large-4), the clause that says so: its
    text model would be refused at setup even with a causal-LM class. Else ``""``."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    folder = model_type_to_module_name(model_type)
    try:
        modeling = importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")
    except ImportError:
        return ""
    refused = next((name for name in INDEXER_REFUSALS if hasattr(modeling, name)), None)
    return "" if refused is None else f", and its {refused} {INDEXER_REFUSALS[refused]}"


def _check_transformers_accepts(config: Mapping[str, Any], owner: str) -> None:
    """``transformers``' own validation of the config (no weights), and what only the first forward would
    find: grouped-query attention needs ``num_attention_heads`` to be a multiple of ``num_key_value_heads``."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.for_model(**config)
    except Exception as error:  # noqa: BLE001 - transformers' validators raise several types
        reason = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        raise ValueError(
            f"{owner}(config=...): transformers refuses this {config['model_type']} config: {reason}"
        ) from None
    # Read from the dict: a per-layer (heterogeneous) config refuses attribute access to these fields.
    values = hf_config.to_dict()
    heads, kv_heads = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise ValueError(
            f"{owner}(config=...): num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv_heads}: choose num_key_value_heads among the divisors of "
            "num_attention_heads."
        )


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = ATTN_IMPLEMENTATION,
) -> nn.Module:
    """The ``AutoModelForCausalLM`` saved in the local directory ``path``, for a module's ``configure_model``,
    in training mode (as a module built from a config is; ``from_pretrained`` alone returns it in eval mode).

    Under :func:`deferred_loading` (``MegatronCPFSDPStrategy``), the parameters are on the ``meta`` device
    and the strategy fills each rank's shards after sharding (:func:`materialize_pretrained`); buffers
    (rotary frequencies) are computed here, and tied embeddings are one parameter. Elsewhere the model is
    loaded whole by ``from_pretrained``. Nothing is downloaded.

    Args:
        path: a directory written by ``save_pretrained`` (``config.json``, ``*.safetensors``).
        dtype: the parameters' dtype; ``None``: ``torch.get_default_dtype()`` (inside ``configure_model``:
            the Trainer's precision, see the module docstring).
        attn_implementation: ``"lightning_cp"`` (context-parallel attention) unless you need another;
            ``None``: the model's default.

    Example::

        def configure_model(self):
            if self.model is None:
                self.model = lightning_cp.load_pretrained("checkpoints/llama-8b")

    Raises:
        ValueError: as :func:`check_causal_lm_config`.
    """
    check_causal_lm_config(str(path), owner="load_pretrained")
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or torch.get_default_dtype()
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    composite = is_composite(config)
    if not _deferring.get() and not composite:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
        # from_pretrained returns the model in eval mode; Lightning keeps the modes it finds, so the model
        # would train without dropout and without transformers' gradient checkpointing (which runs only
        # `if self.training`), unlike the meta-device build below.
        return model.train()
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            text_config(config), dtype=dtype, attn_implementation=attn_implementation
        )
    names = StoredNames(Path(path), composite)
    if composite:
        _say_what_is_trained(Path(path), config, model, names)
    if _deferring.get():
        setattr(model, _PRETRAINED_SOURCE, (Path(path), names))
    else:
        _fill(model, torch.device("cpu"), Path(path), names, distributed=False)
    return model


def _say_what_is_trained(directory: Path, config: Any, model: nn.Module, names: StoredNames) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    text = {names(n) for n in model.state_dict()}
    others = names.others(text)
    towers = sorted({".".join(n.split(".")[:2]) for n in others})
    rank_zero_info(
        f"load_pretrained({str(directory)!r}): a {config.model_type} composite; training its text model "
        f"({type(model).__name__}, stored under {names.body!r}). The other towers ({len(others)} tensors: "
        f"{', '.join(towers)}) are not loaded; export_hf writes them back unchanged."
    )


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on the ``meta`` device; buffers stay real.

    Buffers are computed at construction from the config (rotary ``inv_freq``, attention biases) and are
    usually not in a checkpoint: built on ``meta`` and allocated empty, they would hold garbage and the
    model would run without an error but wrong.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def materialize_pretrained(module: nn.Module, device: torch.device) -> None:
    """Allocate the meta parameters of every :func:`load_pretrained` model in ``module`` and load them.

    Call after ``fully_shard``: each parameter is then a ``DTensor`` and only its local shard is allocated
    (on ``device``: the host under the strategy's ``cpu_offload``) and read, from the model's safetensors
    through ``HuggingFaceStorageReader`` (cast to the parameter's dtype). Buffers keep the values computed at
    construction (on ``device`` too: the strategy moves them after); tied parameters stay one parameter. A
    no-op for a module without meta tensors.

    Communication: ``torch.distributed.checkpoint.load``'s planning collectives over the default group
    (every rank calls this with the same modules); no weights are exchanged.

    Raises:
        ValueError: a parameter on the meta device that no checkpoint fills, or a checkpoint that lacks a
            parameter or holds it in another shape.
    """
    # The model's own attribute: a wrapper that forwards attribute look-ups (peft's PeftModel) is no source.
    sources = [m for m in module.modules() if _PRETRAINED_SOURCE in vars(m)]
    for model in sources:
        directory, names = getattr(model, _PRETRAINED_SOURCE)
        _fill(model, device, directory, names, distributed=True)
        delattr(model, _PRETRAINED_SOURCE)
    left = [name for name, p in module.named_parameters() if p.is_meta]
    left += [name for name, b in module.named_buffers() if b.is_meta]
    if left:
        raise ValueError(
            f"{type(module).__name__}: {', '.join(left[:5])}{' ...' if len(left) > 5 else ''} are on the meta "
            "device and no checkpoint fills them: build pretrained models with lightning_cp.load_pretrained, "
            "other modules on a real device."
        )


def _fill(
    model: nn.Module, device: torch.device, directory: Path, names: StoredNames, *, distributed: bool
) -> None:
    """Allocate ``model``'s meta parameters on ``device`` (each rank's local shards when sharded) and read them
    from ``directory``'s safetensors, where ``names`` says they are (without ``peft``'s ``base_layer``), NF4
    weights by :func:`~lightning_cp.hf.qlora.fill_quantized`. What was not on ``meta`` keeps its value (buffers,
    ``peft`` adapters). ``distributed``: through ``torch.distributed.checkpoint`` (each rank reads the slices it
    owns), else whole tensors with ``safetensors`` in this process."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from lightning_cp.hf.qlora import fill_quantized, is_quantized

    kept = {
        name: t.clone() for name, t in chain(model.named_parameters(), model.named_buffers()) if not t.is_meta
    }
    on_meta = [name for name, p in model.named_parameters() if p.is_meta]
    quantized = [name for name in on_meta if is_quantized(model.get_parameter(name))]
    model.to_empty(device=device)  # every tensor, the kept ones too
    if not distributed:
        model.tie_weights()  # to_empty gave each module its own tensor: tie the embeddings again (FSDP keeps one)
    with torch.no_grad():
        for name, value in kept.items():
            _tensor(model, name).copy_(value)
    reader = HuggingFaceStorageReader(str(directory))
    read = set(on_meta) - set(quantized)
    targets = _targets(model, directory, names, reader.read_metadata().state_dict_metadata, read)
    fill_quantized(model, quantized, directory, names, device)
    if distributed:
        import torch.distributed.checkpoint as dcp

        dcp.load(targets, storage_reader=reader)
        return
    from safetensors import safe_open

    with torch.no_grad():
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), "pt") as handle:
                for key in targets.keys() & set(handle.keys()):
                    targets[key].copy_(handle.get_tensor(key))


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def _targets(
    model: nn.Module, directory: Path, names: StoredNames, stored: Mapping[str, Any], read: set[str]
) -> dict[str, torch.Tensor]:
    """``{stored name: the model's tensor}`` of every parameter named in ``read`` (tied ones once, under the
    name the checkpoint stores) and persistent buffer the checkpoint holds, checked against ``stored`` (the
    checkpoint's tensor metadata by name)."""

    def stored_as(name: str) -> str:
        return names(stored_name(name))

    targets: dict[str, torch.Tensor] = {}
    for group in _tied_names(model):  # one entry per parameter: tied ones are stored once
        if not read.intersection(group):
            continue
        name = next((n for n in group if stored_as(n) in stored), group[0])
        targets[stored_as(name)] = model.get_parameter(name)
    persistent = set(model.state_dict())
    targets.update(
        {stored_as(n): b for n, b in model.named_buffers() if n in persistent and stored_as(n) in stored}
    )
    missing = [name for name in targets if name not in stored]
    wrong = [
        f"{name} {tuple(stored[name].size)} (model: {tuple(tensor.shape)})"
        for name, tensor in targets.items()
        if name in stored and tuple(stored[name].size) != tuple(tensor.shape)
    ]
    if missing or wrong:
        problem = f"lacks {', '.join(missing[:5])}" if missing else f"holds {'; '.join(wrong[:5])}"
        raise ValueError(
            f"The checkpoint in {directory} {problem}: it was not saved from this model's class and config "
            "(load it with transformers' from_pretrained and save_pretrained it again), or the model was given "
            "modules of its own on the meta device after load_pretrained (build those on a real device; peft "
            "adapters are allocated by the strategy)."
        )
    return targets


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter, tied ones (the input and output embeddings) grouped together."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return list(names.values())
