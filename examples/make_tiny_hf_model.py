"""Write a tiny Hugging Face chat model to start a fine-tuning run from: weights, tokenizer and chat data.

``OUT_DIR`` becomes a ``save_pretrained`` directory that ``lightning_cp.models.HFCausalLM(config=OUT_DIR)``
and ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` both load, without any download:

- ``config.json`` + ``model.safetensors``: a randomly initialized Llama (2 layers, hidden size 64, 4 query
  heads sharing 2 key/value heads, tied embeddings);
- the tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``): a byte-level BPE
  trained here, offline, with ``tokenizers`` on the conversations below; EOS ``<|im_end|>`` ends every
  turn, PAD is ``<|endoftext|>``, and the ChatML-style chat template wraps each assistant reply in
  ``{% generation %}`` blocks, so ``return_assistant_tokens_mask=True`` marks what the model should learn;
- ``chat.jsonl``: ``--num-conversations`` conversations (``{"messages": [{"role": ..., "content": ...}]}``,
  an optional system turn, one to three user / assistant exchanges of arithmetic, capitals and word
  reversal), deterministic from ``--seed``; ``text.jsonl``: the same exchanges as plain ``{"text": ...}``
  documents, for ``TextDataModule(format="text")``.

Run it (about a second)::

    python examples/make_tiny_hf_model.py runs/tiny
    lightning-cp fit --config examples/configs/hf_sft_chat_cpu.yaml
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML turns; the assistant's content and its closing ``<|im_end|>`` are the generation (target) span."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CAPITALS = {
    "France": "Paris",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Egypt": "Cairo",
    "Peru": "Lima",
    "Kenya": "Nairobi",
    "Norway": "Oslo",
}
WORDS = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree", "river", "stone", "light", "cloud"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer briefly."]


def exchange(rng: random.Random) -> tuple[str, str]:
    """One user question and the assistant's answer."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        country = rng.choice(sorted(CAPITALS))
        return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."
    words = rng.sample(WORDS, rng.randint(2, 5))
    return f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))


def make_conversations(num: int, seed: int) -> list[list[dict[str, str]]]:
    """``num`` conversations: an optional system turn, then one to three user / assistant exchanges."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(num):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.randint(1, 3)):
            question, answer = exchange(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        conversations.append(messages)
    return conversations


def train_tokenizer(corpus: list[str], vocab_size: int):
    """A byte-level BPE trained on ``corpus``, wrapped for ``transformers`` with EOS, PAD and the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_model(out_dir: Path, tokenizer, seed: int) -> None:
    """A random tiny Llama sized for ``tokenizer``'s vocabulary, written with ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)


def write_tiny_chat_model(
    out_dir: Path, num_conversations: int = 400, vocab_size: int = 512, seed: int = 0
) -> str:
    """Write the model, the tokenizer, ``chat.jsonl`` and ``text.jsonl`` to ``out_dir``; returns a summary line."""
    conversations = make_conversations(num_conversations, seed)
    texts = ["\n".join(m["content"] for m in messages) for messages in conversations]
    tokenizer = train_tokenizer(texts, vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    write_model(out_dir, tokenizer, seed)
    with open(out_dir / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": messages}) + "\n" for messages in conversations)
    with open(out_dir / "text.jsonl", "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return (
        f"wrote a tiny llama (vocab {len(tokenizer)}), its tokenizer with a chat template, {len(conversations)} "
        f"conversations (chat.jsonl) and {len(texts)} documents (text.jsonl) to {out_dir}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="the directory to write, e.g. runs/tiny")
    parser.add_argument("--num-conversations", type=int, default=400, help="conversations in chat.jsonl")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary, special tokens included")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and of the weights")
    args = parser.parse_args()
    if args.num_conversations < 1:
        parser.error(f"--num-conversations {args.num_conversations}: write at least one conversation")
    print(write_tiny_chat_model(args.out_dir, args.num_conversations, args.vocab_size, args.seed))


if __name__ == "__main__":
    main()
