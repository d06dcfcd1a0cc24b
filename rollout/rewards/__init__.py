"""Reward functions: the built-in tasks' verifiable rewards, and user functions loaded from `package.module:function`.

Every reward function has the signature `(prompts, completions, **metadata) -> list[float]`; metadata holds the
dataset's extra columns (e.g. `answer`) as lists aligned with the prompts.
"""
from __future__ import annotations

import functools
import importlib
import threading
from typing import Callable, Optional, Sequence

from common.errors import UserError, shadowed_import

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


def final_answer(answer) -> str:
    """The ground truth a dataset row holds, as text: what follows the last `####` in a GSM8K-style solution
    (`... so she has 42 apples. #### 42` -> `42`, thousands separators dropped), else the value itself; the
    content of the last message when it is a list of assistant messages."""
    if isinstance(answer, list):
        answer = answer[-1]["content"] if answer else ""
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    return text.strip()


def math_reward(prompts: Sequence, completions: Sequence[str], answer: Sequence = None, **_) -> list[float]:
    """1.0 when the completion's final answer (its last `\\boxed{}`, else the last number or expression) equals
    the ground truth mathematically (Hugging Face's math-verify: 0.5 == \\frac{1}{2}), else 0.0. The ground truth
    is the row's `answer` (`data.answer_key`), GSM8K's `#### 42` form included. Where the ground truth is a number,
    the final answer must be one too (a fraction counts): math-verify alone scores an unevaluated `12 - 8` as 4,
    and a policy learns to leave its sums undone (seen: a LoRA run reached 100% by writing every answer that way)."""
    import threading

    from math_verify import parse, verify

    if answer is None:
        raise UserError("reward.fn = math compares each completion with the row's answer, and the data has no "
                        "answer column: set data.answer_key to the column that holds the ground truth")
    # math-verify bounds its work with SIGALRM, which only the main thread may set.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    out = []
    for completion, truth in zip(completions, answer):
        gold = final_answer(truth)
        gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$", parsing_timeout=limit)
        pred = parse(completion, parsing_timeout=limit)
        if gold_parsed and pred and is_number(gold_parsed[0]) and not is_number(pred[0]):
            out.append(0.0)  # an expression left for the grader to evaluate is not the answer
            continue
        out.append(1.0 if gold_parsed and pred and verify(gold_parsed, pred, timeout_seconds=limit) else 0.0)
    return out


def is_number(value) -> bool:
    """A sympy value written as a number: an integer, decimal or fraction (a/b, \\frac{a}{b}), signed or not; not
    an expression such as 12 - 8 or 3 * 4, which sympy keeps unevaluated as math-verify parses it."""
    import sympy
    if not isinstance(value, sympy.Basic):
        return False
    if value.is_Number:
        return True
    if isinstance(value, sympy.Mul) and len(value.args) == 2:  # -5 as -1 * 5, a/b as a * b^-1 (3 * 4 is not)
        a, b = value.args
        negated = a == -1 and b.is_Number
        fraction = a.is_Integer and isinstance(b, sympy.Pow) and b.base.is_Integer and b.exp == -1
        return bool(negated or fraction)
    return False


def guess_reward(prompts: list, completions: list[str], secret: list, **_) -> list[float]:
    """The guessing task as one turn (its SFT evaluation): 1.0 when the first guess is the secret."""
    return [float(c.strip() == str(s)) for c, s in zip(completions, secret)]


BUILTIN = {"sort": sort_reward, "add": add_reward, "math": math_reward, "guess": guess_reward}


def load_reward_fn(spec: str) -> RewardFn:
    """Import `package.module:function`; errors say which part failed and how to fix it."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        fix = shadowed_import(e, module_name) or "; make it importable from the working directory or PYTHONPATH"
        raise UserError(f"reward.fn = {spec!r}: cannot import module {module_name!r} ({e}){fix}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"reward.fn = {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


def resolve_reward_fn(spec: str | None, task: str | None, timeout_s: Optional[float] = None) -> RewardFn:
    """`reward.fn`: a built-in reward's name (sort, add, math), or `package.module:function` (called under a
    deadline of `timeout_s`, when given); unset = the task's."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec is not None:
        fn = load_reward_fn(spec)
        return fn if timeout_s is None else with_deadline(fn, timeout_s)
    if task is None:
        raise UserError("reward.fn is unset and data.task is null: set reward.fn to 'package.module:function' or a "
                        f"built-in reward ({', '.join(BUILTIN)})")
    return BUILTIN[task]


def reward_fn_for(cfg, task: str | None) -> RewardFn:
    """The run's reward function from its `reward` config (common.schema.RewardConfig): a service at
    `reward.url` (rollout.rewards.http), else `reward.fn` or the task's (resolve_reward_fn)."""
    if cfg.url is not None:
        from rollout.rewards.http import HttpReward
        return HttpReward(cfg.url, cfg.url_batch, cfg.url_concurrency, cfg.url_retries, cfg.timeout_s)
    return resolve_reward_fn(cfg.fn, task, cfg.timeout_s)


def with_deadline(fn: RewardFn, timeout_s: float) -> RewardFn:
    """`fn` run on a daemon thread and given up after `timeout_s` (UserError naming it and reward.timeout_s). Python
    cannot stop the thread: at most one is left behind, since the run then stops."""
    name = getattr(fn, "__qualname__", repr(fn))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        box: dict = {}

        def run():
            try:
                box["out"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["error"] = e
        worker = threading.Thread(target=run, daemon=True, name=f"reward {name}")
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise UserError(f"reward function {name} did not return within reward.timeout_s = {timeout_s:g} s for "
                            f"{len(args[1]) if len(args) > 1 else '?'} completions; fix what it waits for, or raise "
                            "reward.timeout_s if it is only slow")
        if "error" in box:
            raise box["error"]
        return box["out"]
    return call


def score(fn: RewardFn, prompts: list, completions: list[str], metadata: dict[str, list]) -> list[float]:
    """Call a reward function and check what it returns: one number per completion. NaN/Inf pass through: they
    make that step's loss non-finite, so its update is skipped and counted (train/skipped_steps)."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        rewards = fn(prompts, completions, **metadata)
    except UserError:  # already says which reward and what is wrong (reward.url's errors)
        raise
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


def score_rows(fn: RewardFn, rows: list[dict], completions: list[str]) -> list[float]:
    """`score` for completions of dataset rows (`rows[i]` is completion i's row): each prompt as the dataset holds
    it, every other column as metadata aligned with the completions."""
    metadata = {k: [r.get(k) for r in rows] for k in rows[0] if k != "prompt"}
    return score(fn, [r["prompt"] for r in rows], completions, metadata)
