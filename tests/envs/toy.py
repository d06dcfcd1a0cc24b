"""Environments written outside the package, as a user would: only `rollout.env` is imported."""
import time

from rollout.env import Environment, StepResult, call_tool


class Echo(Environment):
    """Three turns: each observation names the turn; the reward is 0.25 per turn plus 0.25 for a turn that calls
    the `double` tool. Rows with `hang` sleep in their second step, rows with `explode` raise there, rows that are
    `broken` raise in reset, rows that are `stuck` sleep there."""

    def __init__(self, sleep_s: float = 0.0):
        self.sleep_s, self.turn = sleep_s, 0

    def reset(self, row: dict) -> str:
        if row.get("broken"):
            raise ValueError("this row cannot start a game")
        if row.get("stuck"):
            time.sleep(3600)
        self.row = row
        return f"say {row['word']}"

    def step(self, action: str) -> StepResult:
        self.turn += 1
        time.sleep(self.sleep_s)
        if self.turn == 2 and self.row.get("hang"):
            time.sleep(3600)
        if self.turn == 2 and self.row.get("explode"):
            raise RuntimeError("the environment broke")
        tool = call_tool(action, {"double": lambda s: str(2 * int(s))})
        reward = 0.25 + (0.25 if tool is not None and not tool.startswith("error") else 0.0)
        return StepResult(None if self.turn == 3 else f"turn {self.turn} done", reward, self.turn == 3)


class SortTwice(Environment):
    """The sort task over two turns, from rows with a `question` (no prompt column): the first answer is scored by
    the task's reward and the model is asked again; the trajectory's reward is the mean of both answers' rewards."""

    def reset(self, row: dict) -> str:
        from rollout.rewards import sort_reward
        self.row, self.score, self.turn = row, sort_reward, 0
        return row["question"]

    def step(self, action: str) -> StepResult:
        self.turn += 1
        reward = 0.5 * self.score([self.row["question"]], [action], answer=[self.row["answer"]])[0]
        return StepResult("again" if self.turn == 1 else None, reward, self.turn == 2)
