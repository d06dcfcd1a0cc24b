"""Start-up order: on a shared GPU the rollout engines are created only once every other model is loaded (vLLM
counts what the GPU allocates during its start-up profiling as its own KV-cache budget); elsewhere every role starts
at once."""
import pytest

from rlhf.config import load_config
from rlhf.config.resolve import role_ranks
from rlhf.rl.startup import start_workers


def test_roles_follow_the_config():
    cfg = load_config(None, ["stage=rl", "algorithm.kl_coef=0.1", "trainer.world_size=2"])
    assert role_ranks(cfg, needs_critic=True) == {"policy": 2, "rollout": 1, "reference": 1, "critic": 2}
    lora = load_config(None, ["stage=rl", "algorithm.kl_coef=0.1", "model.lora.rank=4"])
    assert role_ranks(lora, needs_critic=False) == {"policy": 1, "rollout": 1}  # the adapter-off policy is the ref


def test_opd_hosts_a_teacher_whose_tokenizer_is_the_students(tmp_path, tiny_model_dir):
    import json
    import shutil

    from common.errors import UserError
    from rlhf.rl.startup import check_teacher

    def teacher(name: str, vocab_rows: int = 0, swap: bool = False) -> str:
        """A copy of the tiny model with `vocab_rows` more embedding rows, or two of its tokens' ids swapped."""
        out = tmp_path / name
        shutil.copytree(tiny_model_dir, out)
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + vocab_rows}))
        if swap:
            tok = json.loads((out / "tokenizer.json").read_text())
            vocab = tok["model"]["vocab"]
            a, b = list(vocab)[10:12]
            vocab[a], vocab[b] = vocab[b], vocab[a]
            (out / "tokenizer.json").write_text(json.dumps(tok))
        return str(out)

    def check(path: str) -> None:
        check_teacher(load_config(None, ["stage=rl", "algorithm.name=opd", f"teacher.path={path}"]),
                             str(tiny_model_dir))
    cfg = load_config(None, ["stage=rl", "algorithm.name=opd", f"teacher.path={tmp_path / 'nowhere'}"])
    assert role_ranks(cfg, needs_critic=False) == {"policy": 1, "rollout": 1, "teacher": 1}
    with pytest.raises(UserError, match="teacher.path = .*nowhere.*: no config.json there"):
        check_teacher(cfg, str(tiny_model_dir))
    check(str(tiny_model_dir))  # accepted: no error
    check(teacher("bigger", vocab_rows=64))  # Qwen2.5-7B teaching 0.5B: the same tokenizer, more padding rows
    with pytest.raises(UserError, match="embedding has .* rows"):
        check(teacher("smaller", vocab_rows=-8))
    with pytest.raises(UserError, match="tokenizer is not the student's"):  # the same size, other ids
        check(teacher("other", swap=True))
    (tmp_path / "bare").mkdir()
    shutil.copy(tiny_model_dir + "/config.json", tmp_path / "bare")
    with pytest.raises(UserError, match="no tokenizer loads from it"):
        check(str(tmp_path / "bare"))


def _start_and_record(monkeypatch, tmp_path, tiny_model_dir, *overrides) -> list[str]:
    from actors.group import Replicas
    from rollout.group import RolloutGroup

    events = []
    ready, start = Replicas.ready, RolloutGroup.start.__func__
    monkeypatch.setattr(Replicas, "ready", lambda self: (ready(self), events.append("reference loaded")))
    monkeypatch.setattr(RolloutGroup, "start", classmethod(
        lambda cls, *a, **k: (events.append("engines created"), start(cls, *a, **k))[1]))
    cfg = load_config(None, ["stage=rl", "algorithm.kl_coef=0.1", f"output_dir={tmp_path}", "rollout.engine=hf",
                             *overrides])
    workers = start_workers(cfg, str(tiny_model_dir), needs_critic=False)
    try:
        assert workers.startup["time/start_trainers"] > 0 and workers.startup["time/start_engines"] > 0
    finally:
        workers.rollout.shutdown()
        workers.policy.kill()
        workers.reference.kill()
        workers.placement.remove()
    return events


@pytest.mark.slow
def test_engines_are_created_after_the_reference_is_loaded_on_a_shared_gpu(ray_local, tiny_model_dir, monkeypatch,
                                                                           tmp_path):
    events = _start_and_record(monkeypatch, tmp_path, tiny_model_dir, "placement.num_gpus=2")
    assert events == ["reference loaded", "engines created"]


@pytest.mark.slow
def test_every_role_starts_at_once_without_a_shared_gpu(ray_local, tiny_model_dir, monkeypatch, tmp_path):
    events = _start_and_record(monkeypatch, tmp_path, tiny_model_dir)
    assert events == ["engines created", "reference loaded"]
