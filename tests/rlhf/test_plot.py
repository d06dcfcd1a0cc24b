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
