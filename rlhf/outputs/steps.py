"""Each step's account of its time (logging.trace): the step as a span beside the driver's phases and the workers'
calls in `<output_dir>/trace.json` (common.timeline), and the step's row completed with what they add up to:
`time/other` (the step's wall time not in any `time/...` phase, so the phases sum to `time/step`), the
`util/...` fractions, `perf/device_s_per_token` (devices x step seconds per trained token; a device is a GPU the
run holds, on CPU a worker process), and the workers' own spans and the utilisation they show (`perf/..._mfu`,
`perf/decode_bw_util`: rlhf.outputs.worker_spans). Then what the run's rows say at its end: device-hours by phase,
the gain per device-hour, and advice."""
from __future__ import annotations

import os
import time
from typing import Optional

from common import timeline
from rlhf.outputs.worker_spans import WorkerSpans, perf_metrics, to_trace

# (train_worker: inside time/train; eval and trace: after the step, outside time/step)
TIME_KEYS_NOT_PHASES = ("time/step", "time/other", "time/train_worker", "time/eval", "time/trace")


class StepClock:
    def __init__(self, output_dir: str, enabled: bool, num_gpus: int = 0):
        self.trace = timeline.Timeline(os.path.join(output_dir, "trace.json")) if enabled else None
        timeline.install(self.trace)
        self.num_gpus, self.start = num_gpus, 0.0
        self.workers = WorkerSpans() if enabled else None  # (their own spans: forward, backward, generate, ...)

    def begin(self) -> None:
        if self.trace is not None:
            self.trace.take_recent()  # (what came before the step: start-up, evaluation, a checkpoint)
            self.workers.start()  # (before the step's clock starts: the loop times the step after this)
        self.start = timeline.now()

    def end(self, step: int, row: dict) -> None:
        """Complete `row` (its `time/step` already set) and write the step's spans out."""
        phases = sum(v for k, v in row.items() if k.startswith("time/") and k not in TIME_KEYS_NOT_PHASES)
        row["time/other"] = max(row["time/step"] - phases, 0.0)
        if self.trace is None:
            return
        begin, end = time.perf_counter(), timeline.now()
        self.trace.span(timeline.STEPS, f"step {step}", self.start, end, step=step)
        util = timeline.utilisation(self.trace.take_recent(), self.start, end, tuple(self.trace.seen))
        row.update(util)
        devices = self.num_gpus or util.get("util/workers", 0.0)
        tokens: Optional[float] = row.get("train/tokens")
        if tokens and devices:
            row["perf/device_s_per_token"] = devices * row["time/step"] / tokens
        collected = self.workers.collect()
        row.update(perf_metrics(collected))
        to_trace(self.trace, collected)
        self.trace.flush()
        row["time/trace"] = time.perf_counter() - begin  # (what recording costs a step, after it: not in time/step)

    def close(self) -> None:
        if self.trace is not None:
            self.workers.close()
            self.trace.close()
        timeline.install(None)


def mean_of(rows: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def step_hours(rows: list[dict], num_gpus: int) -> float:
    """Device-hours in the run's steps: devices (GPUs, or worker processes) x step seconds."""
    steps = [r for r in rows if "time/step" in r]
    devices = num_gpus or (mean_of(steps, "util/workers") or 1.0)
    return devices * sum(r["time/step"] for r in steps) / 3600


def device_hours(rows: list[dict], num_gpus: int) -> Optional[str]:
    """The run's steps in device-hours, split by phase: 'GPU hours in steps: 0.012 (rollout 48%, train 35%, ...)'."""
    steps = [r for r in rows if "time/step" in r]
    if not steps:
        return None
    total = sum(r["time/step"] for r in steps)
    by_phase: dict[str, float] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("time/") and k not in TIME_KEYS_NOT_PHASES or k == "time/other":
                by_phase[k[5:]] = by_phase.get(k[5:], 0.0) + v
    split = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1]) if v > 0)
    what = "GPU" if num_gpus else "worker-process"
    return f"{what} hours in steps: {step_hours(rows, num_gpus):.3g} ({split})"


def gain_per_hour(rows: list[dict], headline: str, num_gpus: int, price: Optional[float]) -> Optional[str]:
    """The evaluation's gain per device-hour of steps, and with `price` (run.price_per_device_hour) what the steps
    cost and the gain per unit spent: the one number to compare runs by."""
    evals, hours = [r for r in rows if headline in r], step_hours(rows, num_gpus)
    if len(evals) < 2 or hours <= 0:
        return None
    gain = evals[-1][headline] - evals[0][headline]
    line = f"{headline} {gain:+.3f} in {hours:.3g} device-hours: {gain / hours:+.3g} a device-hour"
    if price:
        cost = hours * price
        line += f"; at {price:g} a device-hour the steps cost {cost:.3g}, {gain / cost:+.3g} per unit"
    return line


def advice(rows: list[dict], max_staleness: int, lora: bool, split: bool, on_gpu: bool) -> list[str]:
    """At most two lines naming the largest losses the run's `util/...` and `time/...` show, and the key for each
    (docs/performance.md lists the rules). `split`: engines and trainers on devices of their own (placement.mode
    split on GPUs); colocated, each waits while the other works by design, so their idle time is no loss."""
    steps = [r for r in rows if "time/step" in r]
    if not steps:
        return []
    engines, trainers = mean_of(steps, "util/rollout_engine_busy"), mean_of(steps, "util/policy_trainer_busy")
    sync = sum(r.get("time/sync", 0.0) for r in steps) / sum(r["time/step"] for r in steps)
    found: list[tuple[float, str]] = []
    if split and engines is not None and max_staleness == 0 and engines < 0.5:
        found.append((1 - engines, f"the engines sat idle {1 - engines:.0%} of each step while the trainers "
                                   "worked: rollout.max_staleness=1 generates the next step meanwhile (docs/async.md)"))
    if split and trainers is not None and engines is not None and trainers < 0.4 and engines > 0.8:
        found.append((1 - trainers, f"the trainers waited on generation {1 - trainers:.0%} of each step: more "
                                    "engines (rollout.num_engines), or a shorter rollout.max_new_tokens"))
    rollout = sum(r.get("time/rollout", 0.0) for r in steps) / sum(r["time/step"] for r in steps)
    bandwidth, seqs = mean_of(steps, "perf/decode_bw_util"), mean_of(steps, "perf/decode_seqs")
    if bandwidth is not None and seqs is not None and bandwidth < 0.1 and seqs < 64 and rollout > 0.3:
        keys = "(rollout.prompts_per_step, rollout.n_samples) or fewer engines (rollout.num_engines)"
        found.append((rollout * (1 - bandwidth), f"decoding read {bandwidth:.0%} of the memory bandwidth it had, "
                                                 f"{seqs:.0f} sequences at a time: more at once {keys}"))
    if sync > 0.2:
        fix = "rollout.lora_sync=adapter" if lora and on_gpu else "a larger rollout.sync_bucket_mb"
        found.append((sync, f"the weight sync took {sync:.0%} of each step: {fix}"))
    return [f"advice: {line}" for _, line in sorted(found, key=lambda f: -f[0])[:2]]


def run_totals(rows: list[dict], headline: str, num_gpus: int, price: Optional[float]) -> dict[str, float]:
    """The run's totals, for its last row: `perf/device_hours` in steps (every launch of it), the evaluation's
    `perf/gain_per_device_hour` since the first evaluation, and with `price` `perf/cost`."""
    hours = step_hours(rows, num_gpus)
    out = {"perf/device_hours": hours}
    evals = [r for r in rows if headline in r]
    if len(evals) >= 2 and hours > 0:
        out["perf/gain_per_device_hour"] = (evals[-1][headline] - evals[0][headline]) / hours
    if price:
        out["perf/cost"] = hours * price
    return out
