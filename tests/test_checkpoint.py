"""Checkpoint folder bookkeeping: incomplete folders are invisible, only the newest N are kept, metrics are cut back
to the checkpoint's step (including a line torn by a kill)."""
import json
import os

from rlhf import checkpoint


def test_commit_latest_and_pruning(tmp_path):
    out = str(tmp_path)
    assert checkpoint.latest(out) is None
    for step in (2, 4, 6):
        tmp = checkpoint.begin(out, step)
        open(os.path.join(tmp, "weights"), "w").write(str(step))
        checkpoint.commit(tmp, out, step, {"step": step}, keep_last=2)
    checkpoint.begin(out, 8)  # a crash while writing step 8 leaves only a temp folder
    assert checkpoint.latest(out).endswith("step_000006")
    assert checkpoint.load_driver_state(checkpoint.latest(out)) == {"step": 6}
    assert sorted(n for n in os.listdir(checkpoint.root(out)) if n.startswith("step_")) == ["step_000004",
                                                                                            "step_000006"]


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "trunc')
    checkpoint.truncate_metrics(str(tmp_path), 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
