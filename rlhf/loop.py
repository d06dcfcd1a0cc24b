"""The training loop the in-process stages share (sft, dpo, rm): evaluate first, step, evaluate every `eval.every`
steps and at the end, log every step, checkpoint every `checkpoint.every` steps and at the end, resume from the
newest complete checkpoint, save. Also `BadStepGuard`, which the RL controller uses too."""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, Protocol

from common.errors import TrainingStopped
from rlhf import checkpoint
from rlhf.config import RunConfig, to_yaml
from rlhf.data import BatchIterator
from rlhf.metrics import MetricsLogger, read_metrics


class Checkpointable(Protocol):
    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_hf(self, out_dir: str, tokenizer_path: Optional[str] = None) -> None: ...


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
    logger.console(f"warning: step {step}: update skipped, the loss or gradient norm was NaN/Inf "
                   f"(train/loss {row.get('train/loss', row.get('policy/loss'))}, train/grad_norm "
                   f"{row.get('train/grad_norm')})")


def answer_metric(cfg: RunConfig) -> str:
    """The evaluation figure a stage reports: exact match on the built-in tasks, whose answers are the expected
    text; the share of completions with reward 1.0 under a chosen reward (a verifier accepts many texts)."""
    return "eval/exact_match" if cfg.reward.fn is None else "eval/accuracy"


def eval_summary(rows: list[dict], headline: str) -> str:
    """`<metric> first -> last` for the headline evaluation metric and the widest pass@k logged."""
    evals = [r for r in rows if headline in r]
    passes = sorted((k for k in evals[0] if k.startswith("eval/pass@")), key=lambda k: int(k.split("@")[1]))
    keys = [headline] + passes[-1:]
    return ", ".join(f"{k} {evals[0][k]:.3f} -> {evals[-1][k]:.3f}" for k in keys)


def run_loop(cfg: RunConfig, step_fn: Callable[[int], dict], eval_fn: Callable[[], dict],
             headline: str, trainer: Checkpointable, data: BatchIterator, model_path: str) -> tuple[dict, dict]:
    """Returns (first evaluation, last metrics row); prints `<stage> done: <headline> before -> after`.
    `trainer` saves/loads its DeepSpeed state (model, optimizer, scheduler, RNG) and writes Hugging Face folders
    (a copy in every checkpoint, `<output_dir>/final` at the end); `data` is the batch iterator whose position is
    checkpointed; `model_path` supplies the tokenizer saved alongside."""
    start, guard, resume_from = 0, BadStepGuard(cfg.trainer.max_bad_steps), None
    if cfg.checkpoint.resume and (resume_from := checkpoint.latest(cfg.output_dir)) is not None:
        state = checkpoint.load_driver_state(resume_from)
        checkpoint.truncate_metrics(cfg.output_dir, state["step"])  # steps after it are redone, logged once
        trainer.load_checkpoint(resume_from)
        data.load_state(state["data"])
        start, guard = state["step"], BadStepGuard(cfg.trainer.max_bad_steps, state["guard"])
    else:  # a run killed before its first checkpoint starts over: so does its metrics file
        checkpoint.truncate_metrics(cfg.output_dir, -1)
    logger = MetricsLogger(cfg.output_dir, cfg.logging, cfg.trainer.max_steps, to_yaml(cfg), desc=cfg.stage)
    try:
        if start == 0:
            logger.log(0, eval_fn(), advance=False)
        else:
            logger.console(f"resumed from {resume_from} (step {start})")
        row: dict = {}
        for step in range(start + 1, cfg.trainer.max_steps + 1):
            begin = time.perf_counter()
            row = step_fn(step)
            row["time/step"] = time.perf_counter() - begin
            if step == cfg.trainer.max_steps or (cfg.eval.every and step % cfg.eval.every == 0):
                row.update(eval_fn())
            if guard.observe(row):
                warn_skipped(logger, step, row)
            logger.log(step, row)
            guard.check(step, resume_from)
            if step == cfg.trainer.max_steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                tmp = checkpoint.begin(cfg.output_dir, step)
                trainer.save_checkpoint(tmp)
                trainer.save_hf(os.path.join(tmp, "model_hf"), model_path)
                resume_from = checkpoint.commit(tmp, cfg.output_dir, step, {"step": step, "data": data.state(),
                                                "guard": guard.state()}, cfg.checkpoint.keep_last)
        out = os.path.join(cfg.output_dir, "final")
        trainer.save_hf(out, model_path)
        rows = read_metrics(cfg.output_dir)
        evals = [r for r in rows if headline in r]
        logger.console(f"{cfg.stage} done: {eval_summary(rows, headline)}, model saved to {out}")
        return evals[0], row
    finally:
        logger.close()
