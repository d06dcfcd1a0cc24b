"""Run logging: `<run_dir>/metrics.jsonl` (one object per step), TensorBoard, W&B when configured, and the console
(rlhf.outputs.console): a short line every `logging.console_every` steps and at every evaluation, with warnings. And the
phase timer whose `time/...` metrics those rows carry."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import Optional

from common import timeline
from rlhf.config import LoggingConfig
from rlhf.outputs.console import Console, quiet_transformers, step_line, warnings_for


class PhaseTimer:
    """`with timer("rollout"): ...` adds the block's seconds to `times["time/rollout"]`."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start, wall = time.perf_counter(), time.time()
        with timeline.in_phase(phase):  # (worker calls meanwhile are named by it: common.timeline)
            yield
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - start
        trace = timeline.current()
        if trace is not None:
            trace.span(timeline.DRIVER, phase, wall, time.time())


class MetricsLogger:
    def __init__(self, run_dir: str, cfg: LoggingConfig, total_steps: int, config_yaml: str, desc: str = "train",
                 max_new_tokens: Optional[int] = None):
        """`max_new_tokens`: the rollout budget a truncation warning names (stage rl)."""
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(config_yaml)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")
        self._every = cfg.console_every
        self._tb = self._wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if cfg.wandb_project:
            self._wandb = _start_wandb(cfg.wandb_project, run_dir)
        quiet_transformers()
        self._console, self._total, self._budget = Console(total_steps, desc), total_steps, max_new_tokens
        self.phase = self._console.phase

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                if self._tb is not None:
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if advance:
            self._console.advance(row.get("time/step"))
        if step % self._every == 0 or any(k.startswith("eval/") for k in metrics):
            self.console(step_line(step, self._total, row, self._console.left_s(step)))
            for text in warnings_for(row, self._budget):
                self.warn(text)

    def console(self, text: str) -> None:
        self._console.line(text)

    def warn(self, text: str) -> None:
        self._console.warn(text)

    def close(self) -> None:
        self._console.close()
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class TrainedRows:
    """`<output_dir>/trained_rows.jsonl`: one line a step, `{"step": s, "rows": [dataset row indices it trained]}`,
    cut back to the checkpoint on a resume like metrics.jsonl: whoever wants to can count that each prompt of an
    epoch was trained once."""

    NAME = "trained_rows.jsonl"

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, self.NAME)

    def write(self, step: int, rows: list[int]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "rows": [int(i) for i in rows]}) + "\n")


class RolloutDumps:
    """`<run_dir>/rollouts.jsonl`: every `logging.rollouts_every` steps, the first `logging.rollouts_per_step`
    samples of that step's rollout: the prompt as the model saw it (special tokens and chat template included), the
    completion, its reward and why it stopped. A resumed run first drops what was dumped after its checkpoint; a
    run that starts over starts a new file."""

    NAME = "rollouts.jsonl"

    def __init__(self, run_dir: str, cfg: LoggingConfig, resumed_step: int):
        """`resumed_step`: the step of the checkpoint the run resumes from, -1 for a run from scratch."""
        from rlhf.outputs import checkpoint

        self.path, self.every, self.per_step = os.path.join(run_dir, self.NAME), cfg.rollouts_every, \
            cfg.rollouts_per_step
        checkpoint.truncate_metrics(run_dir, resumed_step, self.NAME)

    def write(self, step: int, rows: list[dict], samples, rewards, renderer) -> None:
        if not self.every or step % self.every:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            for s, reward in zip(samples[:self.per_step], rewards[:self.per_step].tolist()):
                f.write(json.dumps({
                    "step": step, "prompt": renderer.render_text(s.prompt_ids),
                    "completion": renderer.render_text(s.completion_ids), "reward": _plain(float(reward)),
                    "finish_reason": s.finish_reason, "answer": rows[s.prompt_index].get("answer"),
                    **({"turns": s.env.turns} if s.env is not None else {})}) + "\n")


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _plain(v):
    """Python scalars; NaN/Inf become None (JSON null), so metrics.jsonl stays strict JSON."""
    if hasattr(v, "item"):
        v = v.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _start_wandb(project: str, run_dir: str) -> Optional[object]:
    try:
        import wandb
    except ImportError:
        print("logging.wandb_project is set but wandb is not installed; logging to JSONL/TensorBoard only "
              "(pip install wandb to enable it)", file=sys.stderr)
        return None
    return wandb.init(project=project, dir=run_dir)


def since_launch() -> float:
    """Seconds since this process was created (its interpreter start and imports included)."""
    import time

    import psutil
    return time.time() - psutil.Process().create_time()


def startup_line(times: dict[str, float]) -> str:
    """'start-up 12.2 s since launch: inputs 0.1, ray_tokenizer 3.4, trainers 4.7, engines 2.8 (s)' from the
    time/start_* entries, in their order; the parts do not add up to the total (the imports before them are not a
    part, and the engines load while the trainers do: `engines` is the further wait for them)."""
    parts = ", ".join(f"{k[len('time/start_'):]} {v:.1f}" for k, v in times.items()
                      if k.startswith("time/start_") and k != "time/start_since_launch")
    return f"start-up {times['time/start_since_launch']:.1f} s since launch: {parts} (s)"
