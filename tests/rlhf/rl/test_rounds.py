"""The rollout phase's parts: the engines' memory over a step's rounds, and the choice of groups across rounds."""
import torch

from algorithms.advantages import informative_groups
from common.batch import RolloutBatch
from rlhf.rl.rounds import Round, select_groups
from rollout.engine import Sample
from rollout.engines.sleep import EngineMemory


class Engines:
    """Records what the controller asks of the engines' memory."""

    def __init__(self):
        self.calls = []

    def wake_up(self):
        self.calls.append("wake_up")

    def sleep(self):
        self.calls.append("sleep")


def test_engines_wake_once_and_sleep_once_as_soon_as_released():
    engines = Engines()
    with EngineMemory(engines, asleep_between_steps=True) as memory:
        memory.release()
        memory.release()
    assert engines.calls == ["wake_up", "sleep"]
    with EngineMemory(engines, asleep_between_steps=True):
        pass
    assert engines.calls == ["wake_up", "sleep"] * 2
    ahead = Engines()  # rollout.max_staleness > 0: a generation is always in flight, so they never sleep
    with EngineMemory(ahead, asleep_between_steps=False) as memory:
        memory.release()
    assert ahead.calls == []


def _round(rewards: list[float], first_prompt: int) -> Round:
    samples = [Sample(i // 2, [1], [first_prompt + i // 2], [0.0], "stop") for i in range(len(rewards))]
    scores = torch.tensor(rewards)
    rows = [first_prompt + g for g in range(len(rewards) // 2)]  # dataset rows, one a group
    return Round(rows, RolloutBatch.of(samples, scores, pad_id=0), {"rollout/reward_mean": sum(rewards) / len(rewards)},
                 informative_groups(scores, 2))


def test_groups_with_signal_are_chosen_across_rounds_and_renumbered():
    first = _round([1.0, 1.0, 0.0, 1.0], first_prompt=10)  # groups of 2: all-equal, then signal
    second = _round([0.0, 1.0, 0.0, 0.0], first_prompt=20)  # signal, then all-equal
    batch, metrics, rows = select_groups([first, second], want=2, n=2, pad_id=0)
    assert [s.completion_ids[0] for s in batch.samples] == [11, 11, 20, 20]  # the two groups with signal, in order
    assert rows == [11, 20]  # their dataset rows (what trained_rows.jsonl records)
    assert [s.prompt_index for s in batch.samples] == [0, 0, 1, 1]
    assert batch.rewards.tolist() == [0.0, 1.0, 0.0, 1.0] and batch.input_ids.shape[0] == 4
    assert batch.input_ids[:, 1].tolist() == [11, 11, 20, 20]  # the rows are the chosen samples'
    assert set(batch.rows()) == {"input_ids", "attention_mask", "loss_mask", "rollout_logprobs"}
    assert metrics["rollout/kept_group_frac"] == 1.0 and metrics["rollout/informative_frac"] == 0.5
    assert metrics["rollout/fill_rounds"] == 2 and metrics["rollout/reward_mean"] == 0.25  # the last round's


def test_what_every_round_cost_is_summed_over_the_rounds():
    first, second = _round([1.0, 1.0, 0.0, 1.0], first_prompt=10), _round([0.0, 1.0, 0.0, 0.0], first_prompt=20)
    first.metrics.update({"rollout/prefill_tokens": 30.0, "rollout/generated_tokens": 10.0,
                          "rollout/driver_tokens": 44.0, "rollout/sync_wait_s": 0.5})
    second.metrics.update({"rollout/prefill_tokens": 20.0, "rollout/generated_tokens": 40.0,
                           "rollout/driver_tokens": 66.0, "rollout/prefill_per_token": 0.5})
    _, metrics, _ = select_groups([first, second], want=2, n=2, pad_id=0)
    assert metrics["rollout/prefill_tokens"] == 50.0 and metrics["rollout/generated_tokens"] == 50.0
    assert metrics["rollout/driver_tokens"] == 110.0 and metrics["rollout/prefill_per_token"] == 1.0
    assert metrics["rollout/sync_wait_s"] == 0.5  # (generating ahead, only a step's first round reports it)
    assert "rollout/driver_cpu_s" not in metrics  # no round counted it


def test_the_router_agreement_alarm_names_the_key_and_the_fix_only_for_fresh_samples_below_the_floor():
    from rlhf.rl.rounds import agreement_alarm
    low = {"moe/router_agreement": 0.85, "rollout/staleness_max": 0.0}
    said = agreement_alarm(low, 0.9, "measure")
    assert "moe/router_agreement = 0.850 < rollout.router_agreement_warn = 0.9" in said
    assert "15.0% of token-layers" in said and "set algorithm.routing_replay: rollout" in said
    assert "replayed" in agreement_alarm(low, 0.9, "rollout")
    assert agreement_alarm({**low, "moe/router_agreement": 0.95}, 0.9, "measure") is None
    assert agreement_alarm({**low, "rollout/staleness_max": 1.0}, 0.9, "measure") is None  # older weights routed
    assert agreement_alarm({}, 0.9, "off") is None  # (a dense model, or nothing recorded)
