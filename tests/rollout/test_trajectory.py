"""Multi-turn trajectories through the real vLLM engine: token-exact (sampled ids kept, observations rendered by the
chat template), the engine's log-probs agree with the trainer's over whole trajectories, only sampled ids are
trained, and a hanging or raising environment ends its own trajectory and is counted."""
import pytest
import torch

from algorithms.logprobs import token_logprobs
from common.batch import samples_to_batch
from common.errors import UserError
from common.schema import EnvConfig
from rollout.engine import SamplingConfig
from rollout.env import StepResult, call_tool, load_environment
from rollout.multiturn.guess import GuessNumber, demonstration
from rollout.render import PromptRenderer
from tests.fixtures.envs import Echo
from tests.rollout.agreement import logprob_diff

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_mb=16)


def test_load_environment_names_what_is_wrong():
    assert load_environment("tests.fixtures.envs:Echo") is Echo
    for name, why in (("tests.fixtures.envs", "package.module:ClassName"), ("nowhere.at_all:X", "cannot import"),
                      ("tests.fixtures.envs:Nope", "has no 'Nope'"), ("rollout.env:call_tool", "must be a class")):
        with pytest.raises(UserError, match=why):
            load_environment(name)


def test_call_tool_runs_the_named_tool_or_says_which_exist():
    tools = {"double": lambda s: str(2 * int(s))}
    assert call_tool("let me see <tool>double(21)</tool>", tools) == "42"
    assert call_tool("<tool>triple(2)</tool>", tools) == "error: no tool 'triple'; tools: double"
    assert call_tool("42", tools) is None


def test_guess_number_answers_with_the_open_range():
    env = GuessNumber()
    assert env.reset({"secret": 6, "high": 15}) == "guess 1 to 15"
    assert env.step("8") == StepResult("lower, 1 to 7", 0.0, False)
    assert env.step("3") == StepResult("higher, 4 to 7", 0.0, False)
    assert env.step("no idea") == StepResult("a number, 4 to 7", 0.0, False)
    assert env.step(" 6") == StepResult(None, 1.0, True)
    import random
    demo = demonstration(random.Random(0), 6, 15, max_turns=6)
    assert demo[0]["content"] == "guess 1 to 15" and demo[-1] == {"role": "assistant", "content": "6"}


@pytest.mark.slow
def test_trajectories_are_token_exact_agree_with_the_trainer_and_survive_bad_envs(ray_local, tiny_model_dir, capsys):
    from transformers import AutoModelForCausalLM

    from rollout.engines.vllm import VLLMEngine
    from rollout.group import RolloutGroup
    from rollout.multiturn.trajectory import TrajectoryRunner

    renderer = PromptRenderer.from_pretrained(tiny_model_dir)
    group = RolloutGroup.create(1, dict(model_path=tiny_model_dir, **ENGINE), engine_cls=VLLMEngine)
    rows = [{"word": "a"}, {"word": "b", "hang": True}, {"word": "c", "explode": True}, {"word": "d"},
            {"word": "e", "broken": True}]
    cfg = EnvConfig(name="tests.fixtures.envs:Echo", max_turns=3, timeout_s=2.0, num_workers=4)
    runner = TrajectoryRunner(group, renderer, Echo, cfg, max_model_len=256)
    try:
        samples = runner.run(rows, SamplingConfig(max_new_tokens=6, temperature=1.0, n=2))
        _check(samples, rows, renderer, cfg)
        said = capsys.readouterr().err  # the failures are said, with the first one's traceback
        assert "warning: 6 of 10 trajectories failed in the environment Echo" in said and "Traceback" in said
        # The context limit: a trajectory whose next turn would not fit max_model_len ends there, as "length".
        limit = len(samples[0].prompt_ids) + 14
        short = TrajectoryRunner(group, renderer, Echo, cfg, max_model_len=limit)
        for s in short.run(rows[:1], SamplingConfig(max_new_tokens=6, temperature=1.0, n=2)):
            assert s.finish_reason == "length" and s.env.turns < 3 and not s.env.error
            assert len(s.prompt_ids) + len(s.completion_ids) + 6 > limit
    finally:
        group.shutdown()

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = samples_to_batch(samples, renderer.pad_id)
    with torch.no_grad():
        lp = token_logprobs(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1],
                            batch["input_ids"][:, 1:])
    assert logprob_diff(lp, batch) < 1e-3  # over every sampled token of every turn
    assert batch["loss_mask"].sum() == sum(sum(s.completion_mask) for s in samples)


def _check(samples, rows, renderer, cfg) -> None:
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for s in samples[-2:]:  # reset raised: a one-token row that trains nothing, counted as an error
        assert s.env.error and s.env.turns == 0 and s.env.reward == 0.0 and not s.completion_ids
        assert s.prompt_ids == [renderer.pad_id]
    for s, row in zip(samples[:-2], [r for r in rows[:-1] for _ in (0, 1)]):
        bad = row.get("hang") or row.get("explode")
        assert s.env.error == bool(bad) and s.env.turns == (2 if bad else 3)
        assert (s.env.reward == 0.0) if bad else s.env.reward >= 0.75
        assert s.prompt_ids == renderer.prompt_ids([{"role": "user", "content": f"say {row['word']}"}])
        _check_turns(s, renderer, turns=s.env.turns)
    assert sum(s.env.env_time for s in samples if row_hung(s, rows)) >= 2 * cfg.timeout_s  # the hang was waited out


def row_hung(sample, rows) -> bool:
    return bool(rows[sample.prompt_index].get("hang"))


def _check_turns(s, renderer, turns: int) -> None:
    """The completion is sampled turns with the observations between them exactly as turn_ids renders them."""
    ids, mask, i = s.completion_ids, s.completion_mask, 0
    for turn in range(turns):
        start = i
        while i < len(ids) and mask[i]:
            i += 1
        assert i > start  # a sampled turn
        if turn < turns - 1 and i < len(ids):
            sampled = ids[start:i]
            obs = renderer.turn_ids(f"turn {turn + 1} done", closed=sampled[-1] == renderer.close_id)
            assert ids[i:i + len(obs)] == obs and not any(mask[i:i + len(obs)])
            i += len(obs)


def test_a_step_on_which_every_environment_failed_stops_the_run_with_the_first_traceback(tiny_model_dir):
    """No engine is reached: every reset raises, so the step has nothing to train and says why."""
    from rollout.multiturn.trajectory import TrajectoryRunner
    cfg = EnvConfig(name="tests.fixtures.envs:Echo", max_turns=3, timeout_s=5.0, num_workers=2)
    runner = TrajectoryRunner(None, PromptRenderer.from_pretrained(tiny_model_dir), Echo, cfg, max_model_len=256)
    with pytest.raises(UserError) as e:
        runner.run([{"word": "a", "broken": True}] * 3, SamplingConfig(max_new_tokens=4, n=2))
    text = str(e.value)
    assert "every trajectory (6) failed in the environment Echo (env.name = tests.fixtures.envs:Echo)" in text
    assert "ValueError: this row cannot start a game" in text and "fixtures/envs.py" in text and "in reset" in text


def test_environment_calls_that_hang_past_their_bound_stop_the_run(tiny_model_dir):
    from rollout.multiturn.trajectory import MAX_HUNG_PER_WORKER, TrajectoryRunner
    cfg = EnvConfig(name="tests.fixtures.envs:Echo", max_turns=3, timeout_s=0.2, num_workers=1)
    runner = TrajectoryRunner(None, PromptRenderer.from_pretrained(tiny_model_dir), Echo, cfg, max_model_len=256)
    with pytest.raises(UserError, match=rf"{MAX_HUNG_PER_WORKER + 1} calls of the environment tests.fixtures.envs:Echo "
                                        r"are still running after env.timeout_s = 0.2 s"):
        runner.run([{"word": "a", "stuck": True}] * 8, SamplingConfig(max_new_tokens=4, n=1))


class RecordingVLLM:
    """The real vLLM engine, remembering every prompt it was asked to continue (to see where each turn went)."""

    def __init__(self, *args, **kwargs):
        from rollout.engines.vllm import VLLMEngine
        self.engine, self.prompts = VLLMEngine(*args, **kwargs), []

    def generate(self, prompts, sampling):
        self.prompts += [list(p) for p in prompts]
        return self.engine.generate(prompts, sampling)

    def seen(self) -> list[list[int]]:
        return self.prompts

    def shutdown(self) -> None:
        self.engine.shutdown()


@pytest.mark.slow
def test_every_turn_of_a_trajectory_goes_to_the_engine_that_holds_its_conversation(ray_local, tiny_model_dir):
    """Two engines, four rows of two trajectories, three turns each: a trajectory's history is in one engine's
    prefix cache only, so each of its turns (and its group's) must be sent there, not where its position in
    whichever call it joined would put it."""
    from rollout.group import RolloutGroup
    from rollout.multiturn.trajectory import TrajectoryRunner

    renderer = PromptRenderer.from_pretrained(tiny_model_dir)
    group = RolloutGroup.create(2, dict(model_path=tiny_model_dir, **ENGINE), engine_cls=RecordingVLLM)
    words = ["alpha", "bravo", "charlie", "delta"]
    cfg = EnvConfig(name="tests.fixtures.envs:Echo", max_turns=3, timeout_s=30.0, num_workers=4)
    try:
        runner = TrajectoryRunner(group, renderer, Echo, cfg, max_model_len=256)
        samples = runner.run([{"word": w} for w in words], SamplingConfig(max_new_tokens=4, temperature=1.0, n=2))
        seen = ray_local.get([e.seen.remote() for e in group.engines], timeout=60)
    finally:
        group.shutdown()
    assert sum(len(s) for s in seen) >= 2 * 8  # every trajectory took two turns or more
    for word in words:
        engines = {i for i, prompts in enumerate(seen) for p in prompts if f"say {word}" in renderer.decode(p)}
        assert len(engines) == 1, (word, engines)
    assert {i for i, prompts in enumerate(seen) if prompts} == {0, 1}  # both engines took a share
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]
