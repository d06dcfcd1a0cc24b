"""The shared training loop (rlhf.stages.loop.drive) with a stage that only counts: when it evaluates (eval.every)
and what it reports when it never does; a disk that fills up while a checkpoint or the final model is written."""
import errno
import os

import pytest

from common.errors import TrainingStopped
from common.remote import WorkerDied
from rlhf.config import LoggingConfig, load_config
from rlhf.outputs.metrics import MetricsLogger, read_metrics
from rlhf.stages.loop import drive, resume_point
from tests.helpers import ROOT


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


def run_loop(tmp_path, stage, *overrides, steps=5):
    """`drive` over `steps` steps of `stage` into tmp_path, resuming what is there as a rerun does."""
    cfg = load_config(os.path.join(ROOT, "examples", "sort_grpo.yaml"),
                      [f"output_dir={tmp_path}", f"trainer.max_steps={steps}", *overrides])
    logger = MetricsLogger(str(tmp_path), LoggingConfig(tensorboard=False), steps, "", desc="test")
    try:
        return drive(cfg, stage, "grpo", "eval/accuracy", logger, *resume_point(cfg))
    finally:
        logger.close()


@pytest.mark.parametrize("every,evaluated_at", [(2, [0, 2, 4, 5]), (0, [0, 5]), (-1, [])])
def test_eval_every_chooses_the_evaluated_steps_and_minus_one_never_evaluates(tmp_path, capsys, every, evaluated_at):
    stage = CountingStage()
    first, last = run_loop(tmp_path, stage, f"eval.every={every}", "checkpoint.every=0")
    rows = read_metrics(str(tmp_path))
    assert stage.steps == [1, 2, 3, 4, 5] and [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == evaluated_at
    assert stage.evaluations == len(evaluated_at) and last["train/loss"] == 0.2
    assert (first.get("eval/accuracy"), rows[0]["time/start"]) == ((0.25 if evaluated_at else None), 1.0)
    said = capsys.readouterr().out
    assert ("not evaluated (eval.every=-1)" in said) == (every == -1)


class FillingStage(CountingStage):
    """Checkpoints hold a file; the save at step `full_at` (or the final save) writes part of one and then fails
    the way `error` says a full disk does."""

    def __init__(self, full_at, error):
        super().__init__()
        self.full_at, self.error, self.restored = full_at, error, None

    def save(self, folder):
        with open(os.path.join(folder, "weights.bin"), "wb") as f:
            f.write(b"\0" * 4096)
        if self.steps[-1] == self.full_at:
            raise self.error

    def restore(self, folder, state):
        self.restored = (os.path.basename(folder), state["step"])

    def save_final(self, out):
        os.makedirs(out, exist_ok=True)
        if self.full_at == "final":
            raise self.error


def drive_until_stopped(tmp_path, stage):
    return run_loop(tmp_path, stage, "eval.every=0", "checkpoint.every=2")


# as a GRPO run's trainer reported a full 45 MiB tmpfs
TORCH_SHORT_WRITE = ("policy trainer 0 raised RuntimeError: [enforce fail at inline_container.cc:672] . unexpected "
                     "pos 10210880 vs 10210772 (at torch/serialization.py:834 in __exit__)")


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "weights.bin"),
                                   WorkerDied(TORCH_SHORT_WRITE, "policy trainer 0", raised=True)],
                         ids=["os-error", "worker-text"])
def test_a_full_disk_stops_the_run_naming_it_deletes_the_partial_checkpoint_and_a_rerun_resumes(tmp_path, error):
    with pytest.raises(TrainingStopped) as stopped:
        drive_until_stopped(tmp_path, FillingStage(4, error))
    said, ckpts = str(stopped.value), os.path.join(str(tmp_path), "checkpoints")
    assert f"the disk holding {tmp_path} is full: saving checkpoint 4 failed" in said
    assert f"The last checkpoint, {os.path.join(ckpts, 'step_000002')}, is intact" in said and " is free now" in said
    assert sorted(os.listdir(ckpts)) == ["step_000002"]  # the half-written .tmp_step_000004 is gone
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3, 4]
    resumed = FillingStage(None, None)
    drive_until_stopped(tmp_path, resumed)
    assert resumed.restored == ("step_000002", 2) and resumed.steps == [3, 4, 5]
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3, 4, 5]


def test_a_full_disk_at_the_final_save_keeps_the_final_folder_and_other_errors_pass_through_as_they_were(tmp_path):
    with pytest.raises(TrainingStopped, match=r"saving the final model to .*final failed \(.*No space left"):
        drive_until_stopped(tmp_path, FillingStage("final", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    assert os.path.isdir(os.path.join(str(tmp_path), "final"))  # may hold a user's files: never deleted
    with pytest.raises(WorkerDied, match="raised ValueError: a bug"):
        drive_until_stopped(tmp_path / "other", FillingStage(2, WorkerDied("trainer raised ValueError: a bug")))
