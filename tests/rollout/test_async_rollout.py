"""Generating ahead (rollout.sources.ahead) with the real vLLM engine in a Ray actor: a sync lands while samples are
kept in the engine mid-generation, and they continue under the new weights (on their KV so far, or recomputed), each
token keeping the log-prob and version of the weights that sampled it; the pacing never lets a sample fall more
than max_staleness updates behind; the state a checkpoint records continues the same generations."""
import json
import time

import numpy as np
import pytest
import torch

from rlhf.stages.data import BatchIterator
from rollout.engine import SamplingConfig
from rollout.engines.vllm import VLLMEngine
from rollout.group import RolloutGroup
from rollout.sources.ahead import AsyncRollout, staleness_metrics

ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_mb=16)
SAMPLING = SamplingConfig(max_new_tokens=24, temperature=1.0, n=2, seed=3)


class IdRows:
    """Completions of rows that hold their prompt's token ids already (rollout.episodes.Completions renders text)."""
    whole = False

    def encode(self, rows):
        return [r["ids"] for r in rows], ()


def _teacher_forced(model, sample) -> np.ndarray:
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    targets = ids[0, 1:]
    return logp[torch.arange(len(targets)), targets][len(sample.prompt_ids) - 1:].numpy()


def _wait_for(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _kept(old, new, sample) -> np.ndarray:
    """rollout.inflight_kv: keep, as transformers computes it: the context's KV by the old weights (the prompt and
    every token sampled before the sync but the last, which the next step feeds under the new weights), each later
    position by the new weights reading that cache. The log-probs of the tokens sampled after the sync."""
    before = int((sample.versions == 0).sum())
    cut = len(sample.prompt_ids) + before - 1
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    with torch.no_grad():
        past = old(ids[:, :cut], use_cache=True).past_key_values
        logp = torch.log_softmax(new(ids[:, cut:-1], past_key_values=past).logits[0].float(), -1)
    return logp[torch.arange(len(logp)), ids[0, cut + 1:]].numpy()  # the first token after the sync on


@pytest.fixture(scope="module")
def engines(ray_local, tiny_model_dir):
    group = RolloutGroup.create(1, dict(model_path=tiny_model_dir, **ENGINE), timeout_s=300, engine_cls=VLLMEngine)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def recomputing(ray_local, tiny_model_dir):
    group = RolloutGroup.create(1, dict(model_path=tiny_model_dir, inflight_kv="recompute", **ENGINE), timeout_s=300,
                                engine_cls=VLLMEngine)
    yield group
    group.shutdown()


def _old_and_perturbed(model_dir: str):
    """The checkpoint twice: as it is, and with every weight moved (the weights a sync sends)."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return old, new


@pytest.mark.parametrize("inflight_kv", ["keep", "recompute"])
def test_a_sync_lands_mid_generation_and_the_kept_samples_go_on_under_the_new_weights(
        inflight_kv, engines, recomputing, tiny_model_dir):
    group = engines if inflight_kv == "keep" else recomputing
    old, new = _old_and_perturbed(tiny_model_dir)
    rows = [{"ids": [1 + i, 7, 9 + i]} for i in range(8)]
    pipeline = AsyncRollout(group, BatchIterator(rows, 4, seed=0), IdRows(),
                            SAMPLING, max_staleness=1, chunk_tokens=2, last_step=3)
    pipeline.start()
    _wait_for(lambda: pipeline.calls >= 1)  # a first call made: the sync lands while step 1 generates
    pipeline.synced(lambda: group.update_weights(list(new.state_dict().items())), version=1)
    first = pipeline.take(1)
    samples = first.samples(SAMPLING.n)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3] and len(first.row_ids) == 4
    two = [s for s in samples if set(s.versions.tolist()) == {0, 1}]
    assert two, [s.versions for s in samples]  # interrupted by the sync, continued after it
    for s in samples:
        assert len(s.versions) == len(s.completion_ids) == len(s.rollout_logprobs)
        assert (np.diff(s.versions) >= 0).all()  # old tokens first, then the new weights'
        v0, v1 = s.versions == 0, s.versions == 1
        assert np.abs(s.rollout_logprobs[v0] - _teacher_forced(old, s)[v0]).max(initial=0) < 1e-3
        if inflight_kv == "recompute" or not v0.any():  # (a sample started after the sync: all new)
            assert np.abs(s.rollout_logprobs[v1] - _teacher_forced(new, s)[v1]).max(initial=0) < 1e-3
        else:
            assert np.abs(s.rollout_logprobs[v1] - _kept(old, new, s)).max(initial=0) < 1e-3
    later = np.concatenate([s.rollout_logprobs[s.versions == 1] - _teacher_forced(old, s)[s.versions == 1]
                            for s in two])
    assert np.abs(later).mean() > 1e-2  # the new weights' log-probs are not the old ones': the check above can fail
    if inflight_kv == "keep":  # nor, on the old KV, what the new weights compute from scratch
        fresh = np.concatenate([s.rollout_logprobs[s.versions == 1] - _teacher_forced(new, s)[s.versions == 1]
                                for s in two])
        assert np.abs(fresh).mean() > 1e-3
    metrics = staleness_metrics(samples, trainer_version=0)  # step 1 trains version 0: its own tokens, and newer
    assert metrics["rollout/staleness_max"] == 0 and metrics["rollout/interrupted_frac"] > 0

    # Step 2 was started at version 0 (max_staleness 1); step 3 may not start before version 1 -> it starts now.
    second = pipeline.take(2)
    assert staleness_metrics(second.samples(2), trainer_version=1)["rollout/staleness_max"] <= 1
    saved = pipeline.snapshot["async"]  # as of the last sync: steps 1 and 2 in flight, step 3 not yet drawn
    assert [b["step"] for b in saved["queue"]] == [1, 2] and saved["next_step"] == 3
    pipeline.synced(lambda: None, version=2)
    third = pipeline.take(3)
    assert min(int(s.versions.min()) for s in third.samples(2)) >= 1
    pipeline.close()


def test_a_restored_snapshot_continues_the_same_generations(engines):
    rows = [{"ids": [3 + i, 5]} for i in range(8)]
    first = AsyncRollout(engines, BatchIterator(rows, 4, seed=1), IdRows(), SAMPLING, max_staleness=2, chunk_tokens=3,
                         last_step=4)
    assert first.take(1).done
    first.synced(lambda: None, version=1)  # step 1 trained: the checkpoint of version 1 holds steps 2 and 3
    state = first.snapshot
    first.close()
    queued = {b["step"]: b for b in state["async"]["queue"]}
    assert sorted(queued) == [2, 3] and state["async"]["next_step"] == 4  # K = 2: steps up to version 0 + 1 + K
    assert any(len(s["ids"]) for b in queued.values() for s in b["seqs"])  # tokens generated ahead are kept
    # A synchronous loop resumed from it redraws the queued steps' prompts: its position is before them.
    assert state["prompts"] == queued[2]["prompts_before"]

    resumed = AsyncRollout(engines, BatchIterator(rows, 4, seed=1), IdRows(), SAMPLING, max_staleness=2,
                           chunk_tokens=3, last_step=4)
    resumed.load_state(state["async"], step=1)
    got = resumed.take(2)
    kept = queued[2]["seqs"]
    assert got.row_ids == queued[2]["row_ids"]
    for seq, sample in zip(kept, got.samples(2)):
        assert sample.completion_ids[:len(seq["ids"])] == seq["ids"]  # continued, not restarted
        assert sample.versions[:len(seq["ids"])].tolist() == seq["versions"]
    resumed.close()


def test_a_refill_round_is_drawn_now_and_generated_before_the_queued_steps(engines):
    rows = [{"ids": [2 + i, 6]} for i in range(12)]
    pipeline = AsyncRollout(engines, BatchIterator(rows, 4, seed=2), IdRows(), SAMPLING, max_staleness=1,
                            chunk_tokens=4, last_step=2)
    first = pipeline.take(1)  # step 2's prompts were drawn too (K = 1), and are being generated
    pipeline.synced(lambda: None, version=1)
    refill = pipeline.refill(1)  # dynamic sampling wants more groups for step 1, after sync 1 (e.g. on a resume)
    assert refill.step == 1 and refill.done and len(refill.row_ids) == 4
    second = pipeline.take(2)
    assert len(set(first.row_ids + second.row_ids + refill.row_ids)) == 12  # new prompts, each drawn once
    assert {int(v) for s in refill.samples(2) for v in s.versions} == {1}  # all by the engines' current weights
    pipeline.close()


def test_multi_turn_trajectories_continue_across_a_sync_between_their_turns(engines, tiny_model_dir):
    from common.schema import EnvConfig
    from rollout.episodes import Trajectories
    from rollout.render import PromptRenderer
    from tests.fixtures.envs import Echo

    old, new = _old_and_perturbed(tiny_model_dir)
    rows = [{"word": w} for w in ("red", "green", "blue", "black")]
    episodes = Trajectories(Echo, EnvConfig(max_turns=3), max_model_len=128)
    episodes.start(engines, PromptRenderer.from_pretrained(tiny_model_dir))
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, n=2)

    def start(state=None, step=1):
        p = AsyncRollout(engines, BatchIterator(rows, 2, seed=0), episodes, sampling, max_staleness=1, chunk_tokens=4,
                         last_step=2)
        if state is not None:
            p.load_state(state, step=step)
        return p

    engines.update_weights(list(old.state_dict().items()))  # (an earlier test left other weights in the engine)
    pipeline = start()
    pipeline.start()
    _wait_for(lambda: pipeline.busy > 0)  # a first turn in flight: the sync lands after it, before the next turns
    pipeline.synced(lambda: engines.update_weights(list(new.state_dict().items())), version=1)
    saved = pipeline.snapshot["async"]
    first = pipeline.take(1)
    samples = first.samples(2)
    assert len(samples) == 4 and all(s.env.turns == 3 for s in samples)
    for s in samples:
        sampled = np.asarray(s.completion_mask)
        assert len(s.versions) == len(s.completion_ids) and (np.diff(s.versions) >= 0).all()
        assert s.versions[-1] == 1  # at most its first turn was in flight at the sync
        by_old, by_new = _teacher_forced(old, s), _teacher_forced(new, s)
        v0, v1 = sampled & (s.versions == 0), sampled & (s.versions == 1)
        assert np.abs(s.rollout_logprobs[v0] - by_old[v0]).max(initial=0) < 1e-3
        assert np.abs(s.rollout_logprobs[v1] - by_new[v1]).max() < 1e-3
        assert np.abs(s.rollout_logprobs[v1] - by_old[v1]).mean() > 1e-2  # (so the check above can fail)
    # the trajectories of the first turn's call (those whose reset came first) went on under the new weights
    assert staleness_metrics(samples, trainer_version=0)["rollout/interrupted_frac"] > 0
    _wait_for(lambda: pipeline.queue[0].done)  # step 2's trajectories, played while "step 1 trains"
    pipeline.synced(lambda: None, version=2)
    later = json.loads(json.dumps(pipeline.snapshot["async"]))  # as a checkpoint's driver.json holds it
    second = pipeline.take(2).samples(2)
    pipeline.close()
    _check_resumes(start, saved, first, later, second)


def _check_resumes(start, saved: dict, first, later: dict, second: list) -> None:
    """A checkpoint keeps each queued step's rows, and the trajectories of a step whose every trajectory has ended;
    not those in flight (an environment's state is the user's object, not saved): resumed, they are played again
    from the first turn, so every row is still trained once. `saved`: taken at sync 1, while step 1 was played;
    `later`: at sync 2, with step 2 played to the end (`second`, its trajectories)."""
    assert [(b["step"], b["multi_turn"], b["seqs"], b["whole"]) for b in saved["queue"]] == [(1, True, [], None),
                                                                                      (2, True, [], None)]
    resumed = start(saved, step=1)
    again = resumed.take(1)
    assert again.row_ids == first.row_ids and all(s.env.turns == 3 for s in again.samples(2))
    resumed.close()
    assert [b["step"] for b in later["queue"]] == [2] and later["queue"][0]["whole"] is not None
    kept_pipeline = start(later, step=2)
    kept = kept_pipeline.take(2).samples(2)  # (unseeded: played again, they would differ)
    kept_pipeline.close()
    for a, b in zip(second, kept):
        assert (a.completion_ids, a.completion_mask, a.env, a.finish_reason) == \
            (b.completion_ids, b.completion_mask, b.env, b.finish_reason)
        assert np.array_equal(a.rollout_logprobs, b.rollout_logprobs) and np.array_equal(a.versions, b.versions)


def test_a_restarted_engine_is_brought_up_to_date_by_the_controllers_thread(engines):
    """An engine restart met by the generator's thread waits; the controller's thread (the one that talks to the
    trainer ranks) pushes the weights at its next take, so no collective is ever sent from two threads."""
    import threading

    rows = [{"ids": [4 + i, 2]} for i in range(8)]
    pipeline = AsyncRollout(engines, BatchIterator(rows, 4, seed=3), IdRows(),
                            SAMPLING, max_staleness=1, chunk_tokens=4, last_step=2)
    calls = []
    met = threading.Thread(target=pipeline.on_restart, name="generator",
                           args=(0, lambda engine: calls.append((engine, threading.current_thread().name))))
    met.start()
    _wait_for(lambda: pipeline.stale)
    time.sleep(0.2)
    assert met.is_alive() and calls == []  # waiting for the controller's thread
    assert pipeline.take(1).done
    met.join(timeout=10)
    assert not met.is_alive() and calls == [(0, threading.current_thread().name)]
    pipeline.close()
