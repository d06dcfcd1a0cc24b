"""Writes the word problems of examples/smollm2_math_grpo.yaml: chat prompts as verl's parquet rows hold them
(`prompt`: a message list, `reward_model.ground_truth`: the number), scored by the math verifier.

The difficulty is the largest operand (`--max-value`); the instruction asks for the number alone, so a completion
can finish within the recipe's 64 new tokens. With the defaults SmolLM2-135M-Instruct starts at roughly 0.3 greedy
accuracy (docs/real-model.md has the measured table).

    python examples/data/make_word_math.py                  # deterministic: rewrites the same files
    python examples/data/make_word_math.py --max-value 10   # easier
"""
from __future__ import annotations

import argparse
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ["Ann", "Bob", "Sam", "Mia", "Leo", "Zoe"]
THINGS = ["apples", "books", "coins", "shells", "stamps", "cards"]
INSTRUCTION = "Reply with just the number."


def problem(rng: random.Random, max_value: int) -> tuple[str, int]:
    """(question, result): one addition or subtraction of two numbers in [2, max_value]."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, max_value), rng.randint(2, max_value)
    if rng.randrange(2) == 0:
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
    a, b = max(a, b), min(a, b)
    return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b


def row(question: str, result: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}], "data_source": "word_math",
            "reward_model": {"style": "rule", "ground_truth": str(result)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-value", type=int, default=20)
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--eval", type=int, default=128)
    parser.add_argument("--out-dir", default=HERE)
    args = parser.parse_args()
    rng = random.Random(f"word-math-{args.max_value}")
    seen, rows = set(), []
    while len(rows) < args.train + args.eval:  # held-out questions never appear in training
        q, x = problem(rng, args.max_value)
        if q not in seen:
            seen.add(q)
            rows.append(row(q, x))
    for name, part in (("word_math_rl.jsonl", rows[:args.train]), ("word_math_eval.jsonl", rows[args.train:])):
        with open(os.path.join(args.out_dir, name), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)


if __name__ == "__main__":
    main()
