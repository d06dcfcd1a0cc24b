"""Writes the chat word-problem data of examples/chat_math_{sft,grpo}.yaml, in the shapes users bring:

- `chat_math_sft.jsonl`: conversations as TRL's SFT datasets hold them (`{"messages": [user, assistant]}`), the
  assistant ending its worked answer in `\\boxed{}`;
- `chat_math_rl.jsonl` and `chat_math_eval.jsonl`: prompts as verl's parquet rows hold them (`prompt`: a message
  list, `reward_model.ground_truth`: the number), scored by the math verifier (`reward.fn: math`).

    python examples/data/make_chat_math.py        # deterministic: rewrites the same files
"""
from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = ["Ann", "Bob", "Sam", "Mia"]
THINGS = ["apples", "books", "coins", "shells"]


def problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked answer, result): additions and subtractions of numbers below 30."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 29), rng.randint(2, 29)
    kind = rng.randrange(3)
    if kind == 0:
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} now?", f"{a} + {b} = \\boxed{{{a + b}}}", \
            a + b
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", \
            f"{a} - {b} = \\boxed{{{a - b}}}", a - b
    return f"A box holds {a} {thing}. {name} adds {b}. How many {thing} in the box?", \
        f"{a} + {b} = \\boxed{{{a + b}}}", a + b


def write(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def main(out_dir: str = HERE, n_sft: int = 2000, n_rl: int = 2000, n_eval: int = 128) -> None:
    rng = random.Random("chat-math")
    items = [problem(rng) for _ in range(n_sft + n_rl + n_eval)]
    write(os.path.join(out_dir, "chat_math_sft.jsonl"),
          [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
           for q, a, _ in items[:n_sft]])
    for name, part in (("chat_math_rl.jsonl", items[n_sft:n_sft + n_rl]), ("chat_math_eval.jsonl", items[-n_eval:])):
        write(os.path.join(out_dir, name), [{"prompt": [{"role": "user", "content": q}], "data_source": "chat_math",
                                             "reward_model": {"style": "rule", "ground_truth": str(x)}}
                                            for q, _, x in part])


if __name__ == "__main__":
    main()
