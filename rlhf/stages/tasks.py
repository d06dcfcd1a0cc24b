"""Built-in synthetic tasks with verifiable answers, generated from a seed: `sort`, `add` and `guess` (rows for the
multi-turn number-guessing environment, rollout.multiturn.guess, with a demonstration conversation for SFT).

Each task gives prompt/answer rows (SFT data and RL prompts) and preference pairs whose rejected side is a plausible
mistake. Prompts look like `sort 17 203 5 88 =` -> ` 5 17 88 203`, and `add 123 + 45 =` -> ` 168`.
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf.config import DataConfig


def sort_example(rng: random.Random, d: DataConfig) -> dict:
    nums = [rng.randint(0, d.max_value) for _ in range(rng.randint(d.min_items, d.max_items))]
    return {"prompt": "sort " + " ".join(map(str, nums)) + " =", "answer": " " + " ".join(map(str, sorted(nums)))}


def add_example(rng: random.Random, d: DataConfig) -> dict:
    def operand() -> int:
        digits = rng.randint(d.min_items, d.max_items)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1)

    a, b = operand(), operand()
    return {"prompt": f"add {a} + {b} =", "answer": f" {a + b}"}


def sort_mistake(rng: random.Random, row: dict) -> str:
    """A wrong answer a model could plausibly give, its kind drawn uniformly: the input left unsorted, a swapped
    pair, a number dropped, repeated, changed to another value or added. The wider the set, the less a reward model
    trained on these pairs leaves for a policy to exploit (sort_ppo_rm)."""
    target = row["answer"].split()
    given = row["prompt"].split()[1:-1]
    top = max(int(x) for x in target) + 10
    i = rng.randrange(len(target))
    near = [v for v in range(int(target[i]) - 3, int(target[i]) + 4) if v >= 0 and str(v) not in target]
    far = [v for v in range(top) if str(v) not in target]
    other = str(rng.choice(near if near and rng.random() < 0.5 else far))  # off by a little, or anything
    swaps = [target[:j] + [target[j + 1], target[j]] + target[j + 2:] for j in range(len(target) - 1)
             if target[j] != target[j + 1]]
    kinds = [[given] if given != target else [], swaps, [target[:i] + target[i + 1:]],
             [target[:i] + [target[i]] + target[i:]], [target[:i] + [other] + target[i + 1:]],
             [sorted(target + [other], key=int)]]
    return " " + " ".join(rng.choice(rng.choice([k for k in kinds if k])))


def add_mistake(rng: random.Random, row: dict) -> str:
    """A wrong sum: no carries, one digit off by one, or a dropped last digit."""
    a, b = (int(x) for x in row["prompt"][4:-2].split(" + "))
    right = str(a + b)
    no_carry = int("".join(str((int(x) + int(y)) % 10) for x, y in zip(str(a).zfill(12), str(b).zfill(12))))
    i = rng.randrange(len(right))
    off = right[:i] + str((int(right[i]) + rng.choice((1, 9))) % 10) + right[i + 1:]
    options = [str(no_carry), off, right[:-1] or "0"]
    options = [o for o in options if o != right] or [str(a + b + 1)]
    return " " + rng.choice(options)


def guess_example(rng: random.Random, d: DataConfig) -> dict:
    """`high` = data.max_value; the demonstration (`messages`) makes at most data.max_items guesses. As a single-turn
    prompt (SFT evaluation) the answer is the secret: a first guess that hits it."""
    from rollout.multiturn.guess import demonstration, opening

    secret = rng.randint(1, d.max_value)
    return {"prompt": [{"role": "user", "content": opening(d.max_value)}], "answer": str(secret), "secret": secret,
            "high": d.max_value, "messages": demonstration(rng, secret, d.max_value, d.max_items)}


def guess_mistake(rng: random.Random, row: dict) -> str:
    return str(rng.choice([v for v in range(1, row["high"] + 1) if v != row["secret"]] or [0]))


TASKS = {"sort": (sort_example, sort_mistake), "add": (add_example, add_mistake),
         "guess": (guess_example, guess_mistake)}


def make_rows(d: DataConfig, split: str, seed: int) -> list[dict]:
    """`data.num_train` or `data.num_eval` prompt/answer rows; train and eval use different seeds."""
    make, _ = TASKS[d.task]
    rng = random.Random(f"{d.task}-{split}-{seed}")
    n = d.num_train if split == "train" else d.num_eval
    return [make(rng, d) for _ in range(n)]


def make_preference_rows(d: DataConfig, split: str, seed: int) -> list[dict]:
    """Rows with `prompt`, `chosen` (the correct answer) and `rejected` (a plausible mistake)."""
    _, mistake = TASKS[d.task]
    rng = random.Random(f"{d.task}-pref-{split}-{seed}")
    return [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": mistake(rng, r)}
            for r in make_rows(d, split, seed)]
