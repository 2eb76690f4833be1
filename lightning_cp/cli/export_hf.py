"""Write a trained checkpoint as a transformers directory that from_pretrained loads.

Run::

    lightning-cp export-hf CHECKPOINT OUTPUT_DIR [--dtype bfloat16] [--tokenizer DIR] [--max-shard-mb 5120] [--overwrite] [--adapter] [--base DIR]

``CHECKPOINT`` is a ``.ckpt`` file (``MegatronCPStrategy``) or a ``MegatronCPFSDPStrategy`` checkpoint folder
of :class:`~lightning_cp.models.HFCausalLM`; see :func:`lightning_cp.export_hf`. A LoRA run's checkpoint is
written merged, or with ``--adapter`` as the ``peft`` adapter directory that ``PeftModel.from_pretrained``
loads on the pretrained base. Its checkpoint holds the adapters alone and names the base's pretrained
directory, from which the merged model reads the base (``--base DIR`` where the directory has moved; it must
be the same base, which the checkpoint's fingerprint checks). One process, no GPU, one
safetensors shard in memory at a time. A bad checkpoint, or an ``OUTPUT_DIR`` that already holds weights
(the pretrained directory, an earlier export) without ``--overwrite``, is one line on stderr and exit
status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from lightning_cp.hf.export import export_hf


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-cp export-hf CHECKPOINT OUTPUT_DIR ...``; returns the exit status (2: a bad checkpoint or
    output directory)."""
    parser = argparse.ArgumentParser(prog="lightning-cp export-hf", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a .ckpt file or a sharded (FSDP) checkpoint folder")
    parser.add_argument("output_dir", help="the save_pretrained directory to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights")
    parser.add_argument("--tokenizer", help="a tokenizer directory to copy (default: the pretrained one's)")
    parser.add_argument(
        "--max-shard-mb", type=float, default=5120.0, help="the most MiB per safetensors file"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the weights OUTPUT_DIR already holds (every model*.safetensors, index, pytorch_model*.bin)",
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write the peft adapter directory (adapter_config.json, adapter_model.safetensors), "
        "not the merged model",
    )
    parser.add_argument(
        "--base",
        help="a LoRA run's pretrained base directory, where it is not at the path the checkpoint names",
    )
    args = parser.parse_args(argv)
    try:
        output = export_hf(
            args.checkpoint,
            args.output_dir,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
            tokenizer=args.tokenizer,
            max_shard_bytes=int(args.max_shard_mb * 2**20),
            overwrite=args.overwrite,
            adapter=args.adapter,
            base=args.base,
        )
    except ValueError as error:
        print(f"lightning-cp export-hf: error: {error}", file=sys.stderr)
        return 2
    load = (
        "PeftModel.from_pretrained(base, {!r})"
        if args.adapter
        else "AutoModelForCausalLM.from_pretrained({!r})"
    )
    print(f"wrote {output}: {load.format(str(output))}")
    return 0
