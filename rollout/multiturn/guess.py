"""The built-in multi-turn environment: guess a secret number; each wrong guess is answered with the range still
open ("higher, 9 to 15"), so a model that reads its observations can always win and one that ignores them cannot.
Bisection wins within ceil(log2(n + 1)) guesses; the demonstrations (`demonstration`) guess uniformly inside the
open range, so SFT on them leaves room that GRPO closes: more wins within `env.max_turns`, in fewer turns.

    env: {name: rollout.multiturn.guess:GuessNumber, max_turns: 4}
"""
from __future__ import annotations

import random
import re

from rollout.env import Environment, StepResult


OPENING = "guess 1 to {high}"


def opening(high: int) -> str:
    return OPENING.format(high=high)


class GuessNumber(Environment):
    """Rows carry `secret` and `high` (the data task `guess` makes them). Reward 1 for finding the secret.
    `prompt` (env.kwargs): the opening message, `{high}` filled in. The tiny kit's SFT demonstrations open with the
    terse default; a pretrained instruct model needs to be told the game in a sentence."""

    def __init__(self, prompt: str = OPENING):
        try:
            prompt.format(high=1)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"prompt {prompt!r} must be text with at most the placeholder {{high}} ({e!r})") from None
        self.prompt = prompt

    def reset(self, row: dict) -> str:
        self.secret, self.low, self.high = int(row["secret"]), 1, int(row["high"])
        return self.prompt.format(high=self.high)

    def step(self, action: str) -> StepResult:
        found = re.search(r"\d+", action)
        if found is None:
            return StepResult(f"a number, {self.low} to {self.high}", 0.0, False)
        guess = int(found.group())
        if guess == self.secret:
            return StepResult(None, 1.0, True)
        return StepResult(self.reply(guess), 0.0, False)

    def reply(self, guess: int) -> str:
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
            return f"higher, {self.low} to {self.high}"
        self.high = min(self.high, guess - 1)
        return f"lower, {self.low} to {self.high}"


def demonstration(rng: random.Random, secret: int, high: int, max_turns: int) -> list[dict]:
    """A conversation of a player who guesses uniformly within the open range, for at most `max_turns` guesses."""
    env = GuessNumber()
    messages = [{"role": "user", "content": env.reset({"secret": secret, "high": high})}]
    for _ in range(max_turns):
        guess = rng.randint(env.low, env.high)
        messages.append({"role": "assistant", "content": str(guess)})
        result = env.step(str(guess))
        if result.done:
            break
        messages.append({"role": "user", "content": result.observation})
    return messages if messages[-1]["role"] == "assistant" else messages[:-1]
