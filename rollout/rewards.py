"""Reward functions: the built-in tasks' verifiable rewards, and user functions loaded from `package.module:function`.

Every reward function has the signature `(prompts, completions, **metadata) -> list[float]`; metadata holds the
dataset's extra columns (e.g. `answer`) as lists aligned with the prompts.
"""
from __future__ import annotations

import importlib
from typing import Callable, Sequence

from rlhf.errors import UserError

RewardFn = Callable[..., list]


def _partial(pred: list[str], target: list[str]) -> float:
    """Half credit, scaled by the fraction of aligned positions that match."""
    if not pred or not target:
        return 0.0
    hits = sum(a == b for a, b in zip(pred, target))
    return 0.5 * hits / max(len(pred), len(target))


def sort_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str] = None,
                **_) -> list[float]:
    """1.0 for the exact sorted list, else 0.5 x the fraction of positions right. Answers come from the prompt
    (`sort 3 1 2 =`) when no `answer` column is given."""
    out = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        target = answer[i].split() if answer is not None else sorted(prompt.split()[1:-1], key=int)
        pred = completion.split()
        out.append(1.0 if pred == target else _partial(pred, target))
    return out


def add_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str] = None,
               **_) -> list[float]:
    """1.0 for the exact sum, else 0.5 x the fraction of digits right, aligned from the units digit."""
    out = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if answer is not None:
            target = answer[i].strip()
        else:
            a, b = prompt[4:-2].split(" + ")
            target = str(int(a) + int(b))
        pred = completion.strip()
        if pred == target:
            out.append(1.0)
        elif not pred.isdigit():
            out.append(0.0)
        else:
            out.append(_partial(list(reversed(pred)), list(reversed(target))))
    return out


BUILTIN = {"sort": sort_reward, "add": add_reward}


def load_reward_fn(spec: str) -> RewardFn:
    """Import `package.module:function`; errors say which part failed and how to fix it."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"reward.fn = {spec!r}: cannot import module {module_name!r} ({e}); make it importable "
                        "from the working directory or PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"reward.fn = {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


def resolve_reward_fn(spec: str | None, task: str | None) -> RewardFn:
    if spec is not None:
        return load_reward_fn(spec)
    if task is None:
        raise UserError("reward.fn is unset and data.task is null: set reward.fn to 'package.module:function'")
    return BUILTIN[task]


def score(fn: RewardFn, prompts: list[str], completions: list[str], metadata: dict[str, list]) -> list[float]:
    """Call a reward function and check what it returns: one number per completion. NaN/Inf pass through: they
    make that step's loss non-finite, so its update is skipped and counted (train/skipped_steps)."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        rewards = fn(prompts, completions, **metadata)
    except Exception as e:  # a user function can raise anything; report which one and on what
        raise UserError(f"reward function {name} raised {type(e).__name__}: {e} "
                        f"(first sample: prompt={prompts[0]!r}, completion={completions[0]!r})") from e
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(completions):
        got = len(rewards) if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise UserError(f"reward function {name} returned {got} rewards for {len(completions)} completions; "
                        "it must return a list with one float per completion")
    try:
        return [float(r) for r in rewards]
    except (TypeError, ValueError) as e:
        raise UserError(f"reward function {name} returned a non-number: {e}") from None
