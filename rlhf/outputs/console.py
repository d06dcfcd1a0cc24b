"""What a person watching a run sees. Every logged step's full metrics go to metrics.jsonl, TensorBoard and W&B
(rlhf.outputs.metrics); the console gets one short line a step with what a person watches, warnings that stand out, and,
on a terminal only, a progress bar for the run and a live timer for its long phases (evaluation, saving). Off a
terminal (CI, `ray job` logs) everything is plain lines."""
from __future__ import annotations

import math
import statistics
import sys
import threading
from contextlib import contextmanager

# (metrics key, label, format): the line's fields, in order, each shown when the step logged it
FIELDS = (("rollout/reward_mean", "reward", "{:.3f}"), ("eval/accuracy", "eval acc", "{:.3f}"),
          ("eval/exact_match", "eval EM", "{:.3f}"), ("rollout/kl", "kl", "{:.2g}"),
          ("policy/approx_kl", "Δπ", "{:.2g}"), ("policy/entropy", "entropy", "{:.3f}"),
          ("train/loss", "loss", "{:.4g}"), ("rollout/response_len", "len", "{:.1f}"),
          ("rollout/truncated_frac", "cut", "{:.0%}"), ("rollout/signal_frac", "signal", "{:.0%}"),
          ("rollout/staleness_mean", "stale", "{:.2f}"), ("time/step", "s/step", "{:.1f}"),
          ("perf/rollout_tokens_per_s", "tok/s", "{:.0f}"), ("util/bubble", "idle", "{:.0%}"),
          ("perf/policy_trainer_mfu", "mfu", "{:.0%}"))
TRUNCATED_WARN = 0.5  # most completions hit rollout.max_new_tokens
SIGNAL_WARN = 0.25  # few groups have rewards that differ (GRPO/RLOO learn nothing from the others)


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def step_line(step: int, total: int, row: dict, left_s: float | None) -> str:
    """'step 10/20  reward 0.422  kl 0.0012  ...  40.9 s/step  321 tok/s  left 6:50', plus the evaluation's pass@k."""
    parts = [f"step {step}/{total}"]
    for key, label, fmt in FIELDS:
        value = row.get(key)
        if key == "eval/exact_match" and "eval/accuracy" in row:  # a verifier's answers match in many forms
            continue
        if key == "policy/approx_kl" and value == 0:  # one on-policy update: the ratio is 1 by construction
            continue
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(f"{label} {fmt.format(value)}")
    passes = sorted((k for k in row if k.startswith("eval/pass@")), key=lambda k: int(k.split("@")[1]))
    parts += [f"{k[len('eval/'):]} {row[k]:.3f}" for k in passes if isinstance(row[k], (int, float))]
    if left_s is not None and step < total:
        parts.append(f"left {duration(left_s)}")
    return "  ".join(parts)


def warnings_for(row: dict, max_new_tokens: int | None = None) -> list[str]:
    """What in a step's metrics needs a person's attention, each with what to do about it."""
    out = []
    cut = row.get("rollout/truncated_frac")
    if isinstance(cut, float) and cut > TRUNCATED_WARN:
        budget = f" = {max_new_tokens}" if max_new_tokens else ""
        out.append(f"{cut:.0%} of the completions were cut at rollout.max_new_tokens{budget}: raise it, or ask the "
                   "prompts for shorter answers (a cut completion rarely earns a reward)")
    signal = row.get("rollout/signal_frac")
    if isinstance(signal, float) and signal < SIGNAL_WARN:
        out.append(f"only {signal:.0%} of the prompt groups have rewards that differ, and only those train: the "
                   "task is too hard or too easy for the model now (algorithm.oversample draws more groups)")
    return out


class Console:
    """The run's console: `line` and `warn` print above the bar; `advance` moves it; `phase` times a long phase."""

    def __init__(self, total_steps: int, desc: str, stream=None):
        from tqdm import tqdm
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.total, self.durations = total_steps, []
        self._bar = tqdm(total=total_steps, desc=desc, file=self.stream, dynamic_ncols=True, disable=not self.tty,
                         bar_format="{desc} {n_fmt}/{total_fmt} {bar} {elapsed}<{remaining}")

    def line(self, text: str) -> None:
        self._bar.write(text, file=sys.stdout)
        sys.stdout.flush()

    def warn(self, text: str) -> None:
        self.line(f"\033[1;33mWARNING\033[0m {text}" if self.tty else f"WARNING {text}")

    def advance(self, seconds: float | None) -> None:
        if seconds is not None:
            self.durations.append(seconds)
        self._bar.update(1)

    def left_s(self, step: int) -> float | None:
        """Time left at the median of the last 10 steps (evaluations and saving not counted)."""
        recent = self.durations[-10:]
        return statistics.median(recent) * (self.total - step) if recent else None

    def phase(self, what: str):
        return phase(what, self.stream, position=1)

    def close(self) -> None:
        self._bar.close()


@contextmanager
def phase(what: str, stream=None, position: int = 0):
    """On a terminal, a live '<what> 0:12' while the block runs (under the run's bar at position 1); off one,
    nothing: the line that follows says what was done."""
    stream = stream or sys.stderr
    if not stream.isatty():
        yield
        return
    from tqdm import tqdm
    timer = tqdm(desc=what, file=stream, bar_format="{desc} {elapsed}", position=position, leave=False)
    done = threading.Event()

    def tick():
        while not done.wait(0.5):
            timer.refresh()
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        timer.close()


def quiet_transformers() -> None:
    """transformers' own bars ('Loading weights', 'Writing model shards') would interleave with the run's."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()

