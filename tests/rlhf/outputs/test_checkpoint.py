"""Checkpoint folder bookkeeping: incomplete folders are invisible, only the newest N of a run are kept (never another
run's), a checkpoint cut by a crash is named and the one before it resumed, a checkpoint of another run is refused
naming what differs, checkpoint.resume=false moves an earlier run aside, one run at a time holds a folder, and
metrics are cut back to the checkpoint's step (including a line torn by a kill)."""
import json
import os

from rlhf.outputs import checkpoint


def test_commit_latest_and_pruning(tmp_path):
    out = str(tmp_path)
    assert checkpoint.latest(out) is None
    for step in (2, 4, 6):
        tmp = checkpoint.begin(out, step)
        open(os.path.join(tmp, "weights"), "w").write(str(step))
        checkpoint.commit(tmp, out, step, {"step": step}, keep_last=2)
    checkpoint.begin(out, 8)  # a crash while writing step 8 leaves only a temp folder
    assert checkpoint.latest(out).endswith("step_000006")
    assert checkpoint.load_driver_state(checkpoint.latest(out)) == {"step": 6, "files": {"weights": 1}}
    assert sorted(n for n in os.listdir(checkpoint.root(out)) if n.startswith("step_")) == ["step_000004",
                                                                                            "step_000006"]


def test_truncate_metrics_keeps_steps_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(6)) + '{"step": 6, "trunc')
    checkpoint.truncate_metrics(str(tmp_path), 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]


def _commit(out: str, step: int, run: dict = None) -> str:
    tmp = checkpoint.begin(out, step)
    open(os.path.join(tmp, "mp_rank_00_model_states.pt"), "wb").write(b"x" * 64)
    return checkpoint.commit(tmp, out, step, {"step": step, "data": {}, **({"run": run} if run else {})}, 2)


def _cfg(out, *overrides):
    from rlhf.config import load_config
    return load_config(None, [f"output_dir={out}", "stage=sft", *overrides])


def test_a_crash_cut_checkpoint_is_named_and_the_one_before_resumed(tmp_path, capsys):
    from rlhf.stages.loop import resume_point
    out = str(tmp_path)
    _commit(out, 1)
    cut = _commit(out, 2)
    open(os.path.join(cut, "mp_rank_00_model_states.pt"), "wb").close()  # the crash left it empty
    folder, state = resume_point(_cfg(out))
    assert folder.endswith("step_000001") and state["step"] == 1
    assert "mp_rank_00_model_states.pt is 0 bytes, the checkpoint wrote 64" in capsys.readouterr().err
    with open(os.path.join(folder, "driver.json"), "w") as f:
        f.write('{"step": ')  # and a driver.json cut mid-write: no checkpoint is left to resume
    assert resume_point(_cfg(out)) == (None, None)


def test_a_checkpoint_of_another_run_is_refused_naming_each_difference(tmp_path):
    import pytest
    from common.errors import UserError
    from rlhf.outputs.run_identity import identity
    from rlhf.stages.loop import resume_point
    out = str(tmp_path)
    _commit(out, 5, identity(_cfg(out, "trainer.lr=0.001")))
    assert resume_point(_cfg(out, "trainer.lr=0.001", "trainer.max_steps=50", "eval.every=3"))[1]["step"] == 5
    with pytest.raises(UserError) as e:
        resume_point(_cfg(out, "trainer.lr=1e-5"))
    assert "trainer.lr: 0.001 -> 1e-05" in str(e.value) and "checkpoint.resume=false" in str(e.value)
    with pytest.raises(UserError, match="stage: sft -> dpo"):
        resume_point(_cfg(out, "trainer.lr=0.001", "stage=dpo"))


def test_a_lora_checkpoint_is_refused_when_its_base_model_changed_and_older_checkpoints_resume(tmp_path):
    """A LoRA checkpoint holds the adapter alone, so its run identity covers model.path's files; a checkpoint
    written before that (no `base`) still resumes."""
    import pytest
    from common.errors import UserError
    from rlhf.outputs.run_identity import identity
    from rlhf.stages.loop import resume_point
    out, base = str(tmp_path / "run"), tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"w" * 4096)
    lora = [f"model.path={base}", "model.lora.rank=8"]
    run = identity(_cfg(out, *lora))
    assert set(run["base"]) == {str(base)}
    _commit(out, 3, {k: v for k, v in run.items() if k != "base"})
    assert resume_point(_cfg(out, *lora))[1]["step"] == 3
    _commit(out, 4, run)
    (base / "model.safetensors").write_bytes(b"v" * 4096)
    with pytest.raises(UserError, match=f"model.path {base}: its files changed"):
        resume_point(_cfg(out, *lora))
    assert "base" not in identity(_cfg(out, f"model.path={base}"))  # full fine-tuning saves every weight


def test_resume_false_moves_the_earlier_run_aside_and_pruning_stays_within_a_run(tmp_path):
    from rlhf.stages.loop import resume_point
    out = str(tmp_path)
    for step in (90, 100):
        _commit(out, step)
    (tmp_path / "metrics.jsonl").write_text('{"step": 100}\n')
    assert resume_point(_cfg(out, "checkpoint.resume=false")) == (None, None)
    [previous] = [p for p in tmp_path.iterdir() if p.name.startswith("previous-")]
    assert sorted(os.listdir(previous / "checkpoints")) == ["step_000090", "step_000100"]
    assert (previous / "metrics.jsonl").read_text() == '{"step": 100}\n'
    new = [_commit(out, step) for step in (10, 20, 30)]
    assert checkpoint.latest(out) == new[-1] and os.path.isdir(new[-2]) and not os.path.exists(new[0])


def test_a_second_run_into_a_held_folder_is_refused_naming_the_holder(tmp_path):
    import pytest
    from common.errors import UserError
    from rlhf.outputs.run_identity import run_lock
    with run_lock(str(tmp_path)):
        with pytest.raises(UserError, match=f"in use by another run \\(pid {os.getpid()} on"):
            with run_lock(str(tmp_path)):
                pass
    with run_lock(str(tmp_path)):  # released when the first run ends
        pass
