"""Write a synthetic token file for ``configs/packed_sft_token_file.yaml``: EOS-separated documents.

The file has the format :class:`lightning_cp.data.TokenFileDataModule` reads: a flat array of token ids
(no header) in which every document ends with the EOS id, written by
:func:`lightning_cp.data.write_token_file` together with its sidecar ``<path>.json`` (dtype ``uint16``, or
``uint32`` for ``--vocab-size`` above 65536; token count, vocab size, EOS id), so the config needs no
``dtype``. Document lengths (EOS included) are uniform in ``[--min-len, --max-len]``. Each document
repeats its own random pattern of ``--period`` ids up to its length, so every token after the first
``period`` of a document is the token ``period`` places before it: a model learns to predict them by
attending back within the document (across the CP split of the document), while the first ``period``
tokens stay at chance, ``log(vocab_size - 1)``.

Run it::

    python examples/make_token_file.py runs/sft_tokens.bin
    python examples/make_token_file.py runs/sft_tokens.bin --num-docs 500 --min-len 8 --max-len 128

Your own corpus, in the same format::

    from lightning_cp.data import write_token_file

    ids = [t for doc in docs for t in tokenizer.encode(doc) + [tokenizer.eos_token_id]]
    write_token_file("runs/my_tokens.bin", ids, vocab_size=len(tokenizer), eos_id=tokenizer.eos_token_id)

A Megatron-LM / NeMo indexed dataset (``prefix.bin`` + ``prefix.idx``) needs no conversion: pass its prefix
as ``data.init_args.path``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from lightning_cp.data import write_token_file


def make_documents(
    num_docs: int, min_len: int, max_len: int, period: int, vocab_size: int, eos_id: int, seed: int
) -> list[np.ndarray]:
    """``num_docs`` documents: a random pattern of ``period`` ids (never ``eos_id``) repeated, then ``eos_id``."""
    rng = np.random.default_rng(seed)
    documents = []
    for length in rng.integers(min_len, max_len + 1, size=num_docs):
        pattern = rng.integers(0, vocab_size - 1, size=period)
        pattern += pattern >= eos_id  # the vocab_size - 1 ids other than eos_id, uniformly
        documents.append(np.concatenate([np.resize(pattern, length - 1), [eos_id]]))
    return documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="output file, e.g. runs/sft_tokens.bin")
    parser.add_argument("--num-docs", type=int, default=2000, help="number of documents")
    parser.add_argument("--min-len", type=int, default=16, help="shortest document, EOS included (>= 2)")
    parser.add_argument("--max-len", type=int, default=255, help="longest document, EOS included")
    parser.add_argument("--period", type=int, default=16, help="length of the pattern each document repeats")
    parser.add_argument(
        "--vocab-size", type=int, default=1024, help="ids are < vocab-size (<= 65536: uint16, else uint32)"
    )
    parser.add_argument(
        "--eos-id", type=int, default=None, help="end-of-document id (default: vocab-size - 1)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    eos_id = args.vocab_size - 1 if args.eos_id is None else args.eos_id
    if not 2 <= args.min_len <= args.max_len:
        parser.error(f"--min-len {args.min_len} --max-len {args.max_len}: need 2 <= min-len <= max-len.")
    if args.period < 1 or args.num_docs < 1:
        parser.error(f"--period {args.period} --num-docs {args.num_docs}: both must be >= 1.")
    if not 2 <= args.vocab_size <= 2**32:
        parser.error(f"--vocab-size {args.vocab_size}: must be in [2, 2**32] for a uint16 / uint32 file.")
    if not 0 <= eos_id < args.vocab_size:
        parser.error(f"--eos-id {eos_id}: must be in [0, {args.vocab_size}).")

    documents = make_documents(
        args.num_docs, args.min_len, args.max_len, args.period, args.vocab_size, eos_id, args.seed
    )
    tokens = np.concatenate(documents)
    args.path.parent.mkdir(parents=True, exist_ok=True)
    dtype = write_token_file(args.path, tokens, vocab_size=args.vocab_size, eos_id=eos_id)
    lengths = [len(d) for d in documents]
    print(
        f"wrote {len(documents)} documents, {len(tokens)} tokens (lengths {min(lengths)}-{max(lengths)}, "
        f"mean {np.mean(lengths):.1f}; vocab_size {args.vocab_size}, eos_id {eos_id}) as {dtype} to "
        f"{args.path}, dtype recorded in {args.path}.json"
    )


if __name__ == "__main__":
    main()
