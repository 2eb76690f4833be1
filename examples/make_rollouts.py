"""Sample GRPO rollouts of arithmetic questions from a chat model and reward them: a rollout file to train on.

For each of ``--prompts`` questions "What is A plus B?" the model (a ``save_pretrained`` directory with a
chat template, e.g. the one ``make_tiny_hf_model.py`` writes) samples ``--group`` completions at
``--temperature`` (plain sampling: no top-k / top-p, so the sampler's distribution is ``softmax(logits /
temperature)``, the one ``PolicyObjective(temperature=...)`` names). Each completion is rewarded by a check
of its text: 1.0 when it contains the sum as a number, 0.2 when it contains some other number, else 0.0.
One JSON line per rollout::

    {"group": 3, "prompt_ids": [...], "completion_ids": [...], "reward": 0.2, "old_logprobs": [...]}

``completion_ids`` end with the end-of-turn token when the model produced it; ``old_logprobs`` are the
sampler's log-probabilities of the completion tokens, one each (what PPO's ratio divides by).
``lightning_cp.data.RolloutDataModule`` reads the file: GRPO's advantages per group, completion-only targets.

Run it (a few seconds on a CPU)::

    python examples/make_tiny_hf_model.py runs/tiny
    python examples/make_rollouts.py runs/tiny runs/tiny/rollouts.jsonl
    lightning-cp fit --config examples/configs/grpo_tiny_cpu.yaml
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

import torch


def question(rng: random.Random) -> tuple[str, int]:
    """A question and its answer."""
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return f"What is {a} plus {b}?", a + b


def reward(text: str, answer: int) -> float:
    """1.0 when ``text`` holds ``answer`` as a number, 0.2 when it holds another number, else 0.0."""
    numbers = re.findall(r"\d+", text)
    if str(answer) in numbers:
        return 1.0
    return 0.2 if numbers else 0.0


def sample_rollouts(
    model_dir: str, prompts: int, group: int, temperature: float, max_new_tokens: int, seed: int
) -> list[dict]:
    """``prompts * group`` rewarded rollouts of the model in ``model_dir`` (the module docstring's records)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    records = []
    for index in range(prompts):
        text, answer = question(rng)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=group,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
        sampled = out.sequences[:, len(prompt) :]
        logprobs = torch.stack(out.logits, dim=1).float().div(temperature).log_softmax(-1)
        token_logprobs = logprobs.gather(2, sampled[..., None]).squeeze(2)
        for row in range(group):
            ids = sampled[row].tolist()
            if tokenizer.eos_token_id in ids:  # keep the end-of-turn token, drop the padding after it
                ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
            records.append(
                {
                    "group": index,
                    "prompt_ids": prompt,
                    "completion_ids": ids,
                    "reward": reward(tokenizer.decode(ids, skip_special_tokens=True), answer),
                    "old_logprobs": token_logprobs[row, : len(ids)].tolist(),
                }
            )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", help="a save_pretrained directory with a chat template")
    parser.add_argument("output", type=Path, help="the rollout file to write (.jsonl)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO's group size)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.group < 2:
        parser.error(f"--group {args.group}: GRPO's advantages need at least two completions per prompt")
    records = sample_rollouts(
        args.model_dir, args.prompts, args.group, args.temperature, args.max_new_tokens, args.seed
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(record) + "\n" for record in records))
    mean_reward = sum(r["reward"] for r in records) / len(records)
    print(
        f"wrote {len(records)} rollouts ({args.prompts} prompts x {args.group}) to {args.output}, mean reward {mean_reward:.3f}"
    )


if __name__ == "__main__":
    main()
