"""Per-process peak host memory while loading a pretrained model on several ranks: sharded vs whole.

Saves a Llama (``--hidden``, ``--layers``, ``--vocab``; untied embeddings) as bf16 safetensors, then spawns
``--world`` gloo processes on the CPU twice, one fresh group per method:

- ``from_pretrained``: every rank loads the whole model in fp32 (what ``HFCausalLM`` did before
  ``load_pretrained``, and what DDP does);
- ``load_pretrained + FSDP``: the path of ``MegatronCPFSDPStrategy``: built on the meta device under
  ``deferred_loading``, ``fully_shard`` over the world with the model's default units, then
  ``materialize_pretrained`` reads each rank's fp32 shards from the safetensors.

Each rank resets its resident-set high-water mark (``/proc/self/clear_refs``) after the imports and
reports ``VmHWM`` minus the resident set before loading: the memory loading added at its peak. The ideal
of the sharded load is the fp32 model divided by ``--world``.

Run from the repository root::

    python benchmarks/load_memory.py                       # ~134M parameters on 4 ranks
    python benchmarks/load_memory.py --hidden 64 --layers 2 --vocab 512 --world 2
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probes import _status_bytes
from _report import Column, format_table

MIB = 2**20
METHODS = ("from_pretrained", "load_pretrained + FSDP")
COLUMNS = [
    Column("method", "method", align="<"),
    Column("ranks", "world", ".0f"),
    Column("fp32 model MiB", "model", ".1f", MIB),
    Column("peak added MiB (max rank)", "peak", ".1f", MIB),
    Column("x fp32 model", "ratio", ".3f"),
    Column("ideal", "ideal", ".3f"),
]


def _load(directory: str, method: str) -> int:
    """Load ``directory`` by ``method`` in this rank; the bytes its resident set grew at the peak."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from lightning_cp.hf.loading import deferred_loading, load_pretrained, materialize_pretrained
    from lightning_cp.strategies import _fsdp
    from lightning_cp.strategies._modules import default_layer_classes, resolve_classes

    importlib.import_module("transformers.models.llama.modeling_llama")  # code, not loading: before the reset
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_bytes("VmRSS")
    if method == METHODS[0]:
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.float32, attn_implementation="sdpa"
        )
    else:
        with deferred_loading():
            model = load_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
        units = resolve_classes("load_memory", "fsdp_wrap", default_layer_classes(model), model)
        mesh = _fsdp.sharding_mesh(dist.group.WORLD, "cpu")
        model = _fsdp.shard(model, mesh, units, _fsdp.mixed_precision_policy("32-true"))
        materialize_pretrained(model, torch.device("cpu"))
    peak = _status_bytes("VmHWM") - before
    dist.barrier()
    return peak


def _worker(rank: int, world: int, port: int, directory: str, method: str, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import lightning_cp  # noqa: F401  (registers the attention implementation, as a training run does)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    queue.put(_load(directory, method))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def save_model(directory: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random Llama saved as bf16 safetensors in ``directory``; returns its fp32 bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return numel * 4


def measure(directory: str, world: int, method: str) -> int:
    """The largest rank's peak added bytes for ``method`` on ``world`` fresh processes."""
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = _free_port()
    processes = [
        context.Process(target=_worker, args=(rank, world, port, directory, method, queue))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"{method}: a rank exited with status {process.exitcode}")
    return max(queue.get() for _ in processes)


def build_rows(model_bytes: int, world: int, peaks: dict[str, int]) -> list[dict[str, Any]]:
    """Table rows from the fp32 model's bytes and each method's peak."""
    ideals = {METHODS[0]: 1.0, METHODS[1]: 1.0 / world}
    return [
        {
            "method": method,
            "world": world,
            "model": model_bytes,
            "peak": peak,
            "ratio": peak / model_bytes,
            "ideal": ideals[method],
        }
        for method, peak in peaks.items()
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        model_bytes = save_model(Path(directory), args.hidden, args.layers, args.vocab)
        peaks = {method: measure(directory, args.world, method) for method in METHODS}
    print(format_table(build_rows(model_bytes, args.world, peaks), COLUMNS, markdown=True))


if __name__ == "__main__":
    main()
