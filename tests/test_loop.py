"""The shared training loop (rlhf.stages.loop.drive) with a stage that only counts: when it evaluates (eval.every)
and what it reports when it never does."""
import os

import pytest

from rlhf.config import LoggingConfig, load_config
from rlhf.outputs.metrics import MetricsLogger, read_metrics
from rlhf.stages.loop import drive
from tests.conftest import ROOT


class CountingStage:
    """Steps and evaluations counted; checkpoints are empty folders."""

    def __init__(self):
        self.evaluations, self.steps = 0, []

    def step(self, step):
        self.steps.append(step)
        return {"train/loss": 1.0 / step}

    def evaluate(self):
        self.evaluations += 1
        return {"eval/accuracy": 0.25 * self.evaluations}

    def initial_metrics(self):
        return {"time/start": 1.0}

    def save(self, folder):
        os.makedirs(folder, exist_ok=True)

    def driver_state(self):
        return {}

    def restore(self, folder, state):
        raise AssertionError("nothing to resume")

    def save_final(self, out):
        os.makedirs(out, exist_ok=True)


@pytest.mark.parametrize("every,evaluated_at", [(2, [0, 2, 4, 5]), (0, [0, 5]), (-1, [])])
def test_eval_every_chooses_the_evaluated_steps_and_minus_one_never_evaluates(tmp_path, capsys, every, evaluated_at):
    cfg = load_config(os.path.join(ROOT, "examples", "sort_grpo.yaml"),
                      [f"output_dir={tmp_path}", "trainer.max_steps=5", f"eval.every={every}", "checkpoint.every=0"])
    stage = CountingStage()
    logger = MetricsLogger(str(tmp_path), LoggingConfig(tensorboard=False), 5, "", desc="test")
    first, last = drive(cfg, stage, "grpo", "eval/accuracy", logger, None, None)
    logger.close()
    rows = read_metrics(str(tmp_path))
    assert stage.steps == [1, 2, 3, 4, 5] and [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == evaluated_at
    assert stage.evaluations == len(evaluated_at) and last["train/loss"] == 0.2
    assert (first.get("eval/accuracy"), rows[0]["time/start"]) == ((0.25 if evaluated_at else None), 1.0)
    said = capsys.readouterr().out
    assert ("not evaluated (eval.every=-1)" in said) == (every == -1)
