"""The one training loop every stage runs (`drive`): evaluate first, step, evaluate every `eval.every` steps and at
the end, log every step, stop after `trainer.max_bad_steps` bad steps (`BadStepGuard`), checkpoint every
`checkpoint.every` steps and at the end, resume from the newest complete checkpoint, save. A stage supplies its step
and its state (`Stage`): the RL controller is one, `TrainerStage` wraps the in-process sft/dpo/rm stages."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from typing import Callable, Iterator, Optional, Protocol

from common import timeline
from common.errors import TrainingStopped, UserError
from common.remote import WorkerDied
from rlhf.config import RunConfig, to_yaml
from rlhf.config.resolve import precision_facts
from rlhf.outputs import checkpoint
from rlhf.outputs.metrics import MetricsLogger, read_metrics
from rlhf.outputs.run_identity import check_same_run, identity
from rlhf.outputs.steps import StepClock, advice, device_hours, gain_per_hour, run_totals
from rlhf.stages.data import BatchIterator, tokenizer_source

ADVISE_AFTER = 5  # steps after the launch when the advice is said once, if any rule fires


class Checkpointable(Protocol):
    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_hf(self, out_dir: str, tokenizer_path: Optional[str] = None, merged: bool = True) -> None: ...


class BadStepGuard:
    """Counts steps whose update was skipped for a NaN/Inf loss or gradient norm (the workers report
    `train/skipped_updates`, `critic/skipped_updates`) into `train/skipped_steps`, cumulative over the run and its
    resumes, and stops the run after `max_bad_steps` consecutive such steps (0 = never)."""

    def __init__(self, max_bad_steps: int, state: Optional[dict] = None):
        self.max_bad_steps = max_bad_steps
        self.total = (state or {}).get("skipped_steps", 0)
        self.consecutive = (state or {}).get("consecutive", 0)

    def state(self) -> dict:
        return {"skipped_steps": self.total, "consecutive": self.consecutive}

    def observe(self, row: dict) -> bool:
        """Adds `train/skipped_steps` to the step's metrics row; returns whether this step skipped an update."""
        skipped = row.get("train/skipped_updates", 0.0) + row.get("critic/skipped_updates", 0.0) > 0
        self.total += skipped
        self.consecutive = self.consecutive + 1 if skipped else 0
        row["train/skipped_steps"] = float(self.total)
        return skipped

    def check(self, step: int, last_checkpoint: Optional[str]) -> None:
        if self.max_bad_steps and self.consecutive >= self.max_bad_steps:
            raise TrainingStopped(
                f"steps {step - self.consecutive + 1}..{step}: {self.consecutive} consecutive steps had a NaN or Inf "
                f"loss or gradient norm, so their updates were skipped (trainer.max_bad_steps = "
                f"{self.max_bad_steps}). The last checkpoint ({last_checkpoint or 'none written yet'}) is intact. "
                "Look for NaN/Inf in the rewards or data, lower trainer.lr, or raise trainer.max_bad_steps "
                "(0 = never stop).")


def warn_skipped(logger: MetricsLogger, step: int, row: dict) -> None:
    logger.warn(f"step {step}: update skipped, the loss or gradient norm was NaN/Inf "
                f"(train/loss {row.get('train/loss', row.get('policy/loss'))}, train/grad_norm "
                f"{row.get('train/grad_norm')})")


def answer_metric(cfg: RunConfig) -> str:
    """The evaluation figure a stage reports: exact match on the built-in tasks, whose answers are the expected
    text; the share of completions with reward 1.0 under a chosen reward (a verifier accepts many texts)."""
    scored = cfg.reward.fn is not None or cfg.reward.url is not None or cfg.env.name is not None \
        or cfg.agent.fn is not None
    return "eval/accuracy" if scored else "eval/exact_match"


def eval_summary(rows: list[dict], headline: str) -> str:
    """`<metric> first -> last` for the headline evaluation metric and the widest pass@k logged."""
    evals = [r for r in rows if headline in r]
    if not evals:
        return "not evaluated (eval.every=-1)"
    passes = sorted((k for k in evals[0] if k.startswith("eval/pass@")), key=lambda k: int(k.split("@")[1]))
    keys = [headline] + passes[-1:]
    return ", ".join(f"{k} {evals[0][k]:.3f} -> {evals[-1][k]:.3f}" for k in keys)


class Stage(Protocol):
    """What `drive` runs: the RL controller, or a `TrainerStage` (sft, dpo, rm)."""

    def step(self, step: int) -> dict: ...

    def evaluate(self) -> dict: ...

    def initial_metrics(self) -> dict: ...  # logged with step 0's evaluation (e.g. start-up times)

    def save(self, folder: str) -> None: ...  # every worker's state and a Hugging Face copy, into a checkpoint

    def driver_state(self) -> dict: ...  # saved beside it (data position, ...)

    def restore(self, folder: str, state: dict) -> None: ...  # the checkpoint and its driver state back

    def save_final(self, out: str) -> None: ...


def resume_point(cfg: RunConfig) -> tuple[Optional[str], Optional[dict]]:
    """The newest complete checkpoint that reads back whole, and its driver state, or (None, None); one that does not
    (a crash cut its files) is named and the one before it taken. A checkpoint of another run (its recorded identity
    differs: rlhf.outputs.run_identity) stops the run with exit 2. With checkpoint.resume=false an earlier run's
    files are moved aside (checkpoint.set_aside). metrics.jsonl and trained_rows.jsonl are cut to match: the steps
    after the checkpoint are redone and logged once, and a run killed before its first checkpoint starts over with
    new files. Call it before anything appends to the run folder."""
    if not cfg.checkpoint.resume:
        moved = checkpoint.set_aside(cfg.output_dir)
        if moved:
            print(f"checkpoint.resume=false: the earlier run's checkpoints and metrics are now in {moved}",
                  file=sys.stderr)
    folder, state = next(resumable(cfg), (None, None))
    cut_logs(cfg, state)
    return folder, state


def resumable(cfg: RunConfig, older_than: Optional[int] = None) -> Iterator[tuple[str, dict]]:
    """(folder, driver state) of each complete checkpoint of this run whose driver state reads back whole, newest
    first (only those before step `older_than`, if given); the others are named as they are passed over."""
    now = None
    for path in checkpoint.complete(cfg.output_dir):
        try:
            state = checkpoint.load_driver_state(path)
        except ValueError as e:
            print(f"warning: checkpoint {path} cannot be restored ({e}); taking the one before it", file=sys.stderr)
            continue
        if older_than is not None and state["step"] >= older_than:
            continue
        if "run" in state:  # (checkpoints of earlier versions carry none)
            now = now or identity(cfg)  # (it reads the data files, and with LoRA the model's: once)
            check_same_run(path, state["run"], now, cfg.output_dir)
        yield path, state


def cut_logs(cfg: RunConfig, state: Optional[dict]) -> None:
    for name in ("metrics.jsonl", "trained_rows.jsonl"):
        checkpoint.truncate_metrics(cfg.output_dir, state["step"] if state else -1, name)


def restore_newest(cfg: RunConfig, stage: "Stage", folder: str, state: dict) -> tuple[str, dict]:
    """Restore `folder`; a checkpoint whose files do not load (same size, wrong content: what the manifest cannot
    see) is named and the next older one of the run restored instead (the logs cut back to it). A worker that died
    or timed out is not the checkpoint's fault: that error propagates."""
    while True:
        try:
            stage.restore(folder, state)
            return folder, state
        except Exception as e:  # noqa: BLE001 — any error of a loader; a dead worker is re-raised below
            if isinstance(e, WorkerDied) and (not e.raised or e.start_failed):
                raise
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            failed = folder
            folder, state = next(resumable(cfg, older_than=state["step"]), (None, None))
            if folder is None:
                raise UserError(f"checkpoint {failed} does not load ({cause}) and no older checkpoint of this run "
                                f"is left. Move it away to start over, or set checkpoint.resume=false (the run's "
                                f"files are then moved aside)") from e
            print(f"warning: checkpoint {failed} does not load ({cause}); restoring {folder} instead",
                  file=sys.stderr)
            cut_logs(cfg, state)


def timed_evaluation(stage: Stage, logger: MetricsLogger) -> dict:
    """The stage's evaluation metrics and `time/eval`, its seconds (outside `time/step`); a timer on the console."""
    begin, wall = time.perf_counter(), timeline.now()
    with logger.phase("evaluating"), timeline.in_phase("eval"):
        metrics = stage.evaluate()
    if timeline.current() is not None:
        timeline.current().span(timeline.DRIVER, "eval", wall, timeline.now())
    return {**metrics, "time/eval": time.perf_counter() - begin}


def drive(cfg: RunConfig, stage: Stage, name: str, headline: str, logger: MetricsLogger,
          resume_from: Optional[str], state: Optional[dict]) -> tuple[dict, dict]:
    """The one training loop: evaluate first (or resume from `resume_from`), step, evaluate every `eval.every`
    steps and at the end, log every step, stop after too many bad steps, checkpoint every `checkpoint.every` steps
    and at the end, save. Returns (first evaluation, last metrics row); prints `<name> done: <headline> before ->
    after`."""
    start, guard, run_id = 0, BadStepGuard(cfg.trainer.max_bad_steps), identity(cfg)
    evaluating = cfg.eval.every >= 0  # -1: never (a run timed against a trainer that does not evaluate)
    if resume_from is not None:
        resume_from, state = restore_newest(cfg, stage, resume_from, state)
        start, guard = state["step"], BadStepGuard(cfg.trainer.max_bad_steps, state.get("guard"))
        logger.console(f"resumed from {resume_from} (step {start})")
    else:
        logger.log(0, {**(timed_evaluation(stage, logger) if evaluating else {}), **stage.initial_metrics(),
                       **precision_facts(cfg)[0]}, advance=False)  # (a result compared across precisions says so)
    row: dict = {}
    clock = StepClock(cfg.output_dir, cfg.logging.trace, cfg.placement.num_gpus)  # (logging.trace)
    try:
        for step in range(start + 1, cfg.trainer.max_steps + 1):
            clock.begin()
            begin = time.perf_counter()
            row = stage.step(step)
            row["time/step"] = time.perf_counter() - begin
            clock.end(step, row)
            if evaluating and (step == cfg.trainer.max_steps or (cfg.eval.every and step % cfg.eval.every == 0)):
                row.update(timed_evaluation(stage, logger))
            if guard.observe(row):
                warn_skipped(logger, step, row)
            if step == cfg.trainer.max_steps:  # (the run's device-hours and gain per device-hour: rlhf.outputs.steps)
                row.update(run_totals(read_metrics(cfg.output_dir) + [row], headline, cfg.placement.num_gpus,
                                      cfg.run.price_per_device_hour))
            logger.log(step, row)
            if step == start + ADVISE_AFTER < cfg.trainer.max_steps:
                say_where_time_went(cfg, read_metrics(cfg.output_dir)[-ADVISE_AFTER:], logger, headline, early=True)
            guard.check(step, resume_from)
            if step == cfg.trainer.max_steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                tmp = checkpoint.tmp_folder(cfg.output_dir, step)
                with stopped_if_disk_full(cfg.output_dir, f"saving checkpoint {step}", resume_from, tmp), \
                        logger.phase(f"saving checkpoint {step}"), timeline.in_phase("checkpoint"):
                    stage.save(checkpoint.begin(cfg.output_dir, step))
                    resume_from = checkpoint.commit(tmp, cfg.output_dir, step, {
                        "step": step, **stage.driver_state(), "guard": guard.state(), "run": run_id},
                        cfg.checkpoint.keep_last)
        out = os.path.join(cfg.output_dir, "final")
        with stopped_if_disk_full(cfg.output_dir, f"saving the final model to {out}", resume_from), \
                logger.phase("saving the final model"), timeline.in_phase("save"):
            stage.save_final(out)
    finally:  # (the trace closed, and no timeline left installed, however the run ends)
        clock.close()
    rows = read_metrics(cfg.output_dir)
    logger.console(f"{name} done: {eval_summary(rows, headline)}, model saved to {out}")
    say_where_time_went(cfg, rows, logger, headline)
    return next((r for r in rows if headline in r), {}), row


def say_where_time_went(cfg: RunConfig, rows: list[dict], logger: MetricsLogger, headline: str,
                        early: bool = False) -> None:
    """The run's device-hours by phase, its gain per device-hour (and cost), and advice on its largest losses
    (rlhf.outputs.steps). `early`: the advice alone, from the first steps (ADVISE_AFTER), said once while the run
    goes on."""
    gpus = cfg.placement.num_gpus
    hints = advice(rows, cfg.rollout.max_staleness, cfg.model.lora.rank > 0, gpus > 0 and cfg.placement.mode == "split",
                   gpus > 0)
    if early:
        for line in hints:
            logger.console(f"{line} (from the first {len(rows)} steps)")
        return
    gain = gain_per_hour(rows, headline, gpus, cfg.run.price_per_device_hour)
    for line in filter(None, [device_hours(rows, gpus), gain, *hints]):
        logger.console(line)


@contextlib.contextmanager
def stopped_if_disk_full(output_dir: str, what: str, last_checkpoint: Optional[str], partial: Optional[str] = None):
    """A write that fills the disk (checkpoint.out_of_space) stops the run with TrainingStopped saying so, after
    deleting the temp folder `partial` it left half-written (a checkpoint's; the final model's folder is never
    deleted: it may hold a user's earlier files); any other error passes through. Without this a full disk ended a
    run with a traceback from inside torch or a worker, its partial checkpoint still taking the space."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 — only a full disk is handled; everything else is re-raised
        if not checkpoint.out_of_space(e, output_dir):
            raise
        if partial:
            shutil.rmtree(partial, ignore_errors=True)
        cause = (str(e).strip().splitlines() or [type(e).__name__])[0]
        where = (f"The last checkpoint, {last_checkpoint}, is intact: rerun the same command to resume from it"
                 if last_checkpoint else "No checkpoint was written yet: a rerun starts over")
        deleted = "Its partial files were deleted; " if partial else ""
        raise TrainingStopped(
            f"the disk holding {output_dir} is full: {what} failed ({cause}). {deleted}"
            f"{checkpoint.size_text(checkpoint.free_bytes(output_dir))} is free now. {where} once there is room (free "
            "space, keep fewer checkpoints with checkpoint.keep_last, or point output_dir at another disk).") from None


class TrainerStage:
    """An in-process stage (sft, dpo, rm): a step function, an evaluation, one trainer (DeepSpeed state, Hugging
    Face folders: a copy in every checkpoint, `<output_dir>/final` at the end) and the batch iterator whose
    position is checkpointed; `model_path` supplies the tokenizer saved alongside."""

    def __init__(self, step_fn: Callable[[int], dict], eval_fn: Callable[[], dict], trainer: Checkpointable,
                 data: BatchIterator, model_path: str):
        self.step, self.evaluate = step_fn, eval_fn
        self.trainer, self.data, self.model_path = trainer, data, model_path

    def initial_metrics(self) -> dict:
        return {}

    def save(self, folder: str) -> None:
        self.trainer.save_checkpoint(folder)  # with LoRA, the adapter's copy alone: the base is model.path
        self.trainer.save_hf(os.path.join(folder, "model_hf"), self.model_path, merged=False)

    def driver_state(self) -> dict:
        return {"data": self.data.state()}

    def restore(self, folder: str, state: dict) -> None:
        self.trainer.load_checkpoint(folder)
        self.data.load_state(state["data"])

    def save_final(self, out: str) -> None:
        self.trainer.save_hf(out, self.model_path)


def run_loop(cfg: RunConfig, step_fn: Callable[[int], dict], eval_fn: Callable[[], dict],
             headline: str, trainer: Checkpointable, data: BatchIterator, model_path: str) -> tuple[dict, dict]:
    """An in-process stage through `drive`; returns (first evaluation, last metrics row)."""
    resume_from, state = resume_point(cfg)
    logger = MetricsLogger(cfg.output_dir, cfg.logging, cfg.trainer.max_steps, to_yaml(cfg), desc=cfg.stage)
    try:
        stage = TrainerStage(step_fn, eval_fn, trainer, data, tokenizer_source(cfg, model_path))
        return drive(cfg, stage, cfg.stage, headline, logger, resume_from, state)
    finally:
        logger.close()


def worker_died(error: Exception, last_checkpoint, step: str = "") -> str:
    """One paragraph for a worker that failed mid-run: which one, the cause, and how to go on. "Rerun" is advised
    for a death or a timeout only: a worker that raised would raise again. `step`: what the step in progress held
    ("16 rows x 2112 tokens"), said where the worker ran out of memory."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    where = f"The last checkpoint, {last_checkpoint}, is intact" if last_checkpoint else \
        "No checkpoint was written yet"
    if getattr(error, "out_of_memory", False):
        held = f" The step held {step}." if step else ""
        return (f"{str(error).rstrip('. ')}.{held} {where}; with one of those keys changed, rerun the same command "
                f"to {'resume from it' if last_checkpoint else 'start again'}.")
    if getattr(error, "raised", False):
        after = f"{where}; once fixed, a rerun resumes from it." if last_checkpoint else f"{where}."
        return (f"{str(error).rstrip('. ')}. The worker raised this error itself (it did not crash), so rerunning "
                f"the same command would stop the same way: fix its cause first. {after}")
    return (f"{first.rstrip(':. ')}. A Ray worker process ended while the run needed it: most often it ran out of "
            f"memory (see `dmesg` or the Ray logs), or it was killed. {where}; rerun the same command to resume "
            "from it.")
