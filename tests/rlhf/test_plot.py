"""The plot command draws a PNG from a run's metrics, and names the problem when there is no run."""
import json

from rlhf.plot import main, plot_run


def test_plot_writes_png(tmp_path):
    rows = [{"step": 0, "eval/exact_match": 0.25}] + [
        {"step": s, "rollout/reward_mean": 0.1 * s, "policy/loss": 0.01, "rollout/logprob_diff": 4e-7,
         "time/rollout": 0.4, "time/train": 0.9, "time/sync": 0.02, "time/step": 1.5} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = plot_run(str(tmp_path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_metrics_exits_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_a_run_with_a_trace_also_gets_its_timeline(tmp_path):
    from common.timeline import DRIVER, STEPS, Timeline
    rows = [{"step": s, "time/rollout": 0.4, "time/train": 0.5, "time/step": 1.0, "util/rollout_engine_busy": 0.4,
             "util/policy_trainer_busy": 0.5} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = Timeline(str(tmp_path / "trace.json"))
    for s in (0, 1):
        trace.span(STEPS, f"step {s + 1}", s, s + 1.0)
        trace.span(DRIVER, "rollout", s, s + 0.4)
        trace.span("rollout engine 0", "rollout", s, s + 0.4)
        trace.span("policy trainer 0", "train", s + 0.4, s + 0.9)
    trace.flush()  # (a run still writing)
    plot_run(str(tmp_path))
    with open(tmp_path / "plots" / "timeline.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
