"""Multi-turn environments: the contract code outside the project implements, and a helper for tool calls.

An `Environment` is made once per trajectory (`env.name: package.module:ClassName`, constructed with `env.kwargs`).
`reset(row)` gives the first user message from a dataset row; then each model turn's text goes to `step(action)`,
whose observation becomes the next user (or tool) turn, until `done` or `env.max_turns`. The trajectory's reward is
the sum of its steps' rewards. `rollout.multiturn.trajectory` runs many of them at once, stepping environments in a
thread pool while the engines generate other trajectories' turns.

Tools are plain functions an environment calls when the action asks for one; `call_tool` covers the common form
`<tool>name(argument)</tool>`, the tool's result then being the observation:

    class Calculator(Environment):
        def reset(self, row): self.answer = row["answer"]; return row["question"]
        def step(self, action):
            result = call_tool(action, {"add": lambda s: str(sum(int(x) for x in s.split(",")))})
            if result is not None:
                return StepResult(observation=result, reward=0.0, done=False)
            return StepResult(observation=None, reward=float(action.strip() == self.answer), done=True)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from common.errors import UserError, load_named


@dataclass
class StepResult:
    observation: Optional[str]  # the next user/tool turn's text; None when done
    reward: float  # this turn's reward (the trajectory's reward is their sum)
    done: bool


class Environment:
    """Subclass and implement both methods. One instance serves one trajectory; it may keep any state."""

    def reset(self, row: dict) -> str:
        """The first user message, from a dataset row (its metadata columns included)."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """`action`: the model's text for this turn (special tokens dropped)."""
        raise NotImplementedError


def load_environment(name: str) -> type:
    """The class named `package.module:ClassName` (env.name); UserError saying what is wrong otherwise."""
    cls = load_named(name, "env.name", "package.module:ClassName")
    if not (isinstance(cls, type) and callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise UserError(f"env.name = {name!r}: {name.partition(':')[2]} must be a class with reset(row) and "
                        "step(action) (subclass rollout.env.Environment)")
    return cls


TOOL_CALL = re.compile(r"<tool>\s*([A-Za-z_][\w.]*)\s*\((.*?)\)\s*</tool>", re.S)


def call_tool(action: str, tools: Mapping[str, Callable[[str], str]]) -> Optional[str]:
    """The result of the first `<tool>name(argument)</tool>` in `action` (the tool gets the argument text), an
    error message naming the known tools when `name` is not one of them, or None when the action calls no tool."""
    found = TOOL_CALL.search(action)
    if found is None:
        return None
    name, argument = found.group(1), found.group(2)
    if name not in tools:
        return f"error: no tool {name!r}; tools: {', '.join(sorted(tools))}"
    return str(tools[name](argument))
