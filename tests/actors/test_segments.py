"""An agent episode whose calls broke its history trains every context: the contexts are joined into one row whose
later ones are separate sequences (Sample.segments -> position ids that restart). Every forward that scores such a
row (the trainer's padded, packed and shared-prefix paths, the reference model) gives each context the log-probs it
has alone (the critic its values), and the row trains each context's sampled tokens."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from common.batch import samples_to_batch, segment_positions
from rollout.agents.episode import joined
from rollout.engine import Sample
from rollout.multiturn.trajectory import Trajectory


def context(index: int, prompt: list[int], turns: list[list[int]], observation: list[int]) -> Trajectory:
    """A context: its prompt, then model turns (log-prob -0.5 each id) with `observation` between them."""
    t = Trajectory(index, ids=list(prompt), prompt_len=len(prompt))
    for i, turn in enumerate(turns):
        if i:
            t.add_observation(observation)
        t.add_turn(Sample(index, t.ids, turn, np.full(len(turn), -0.5, np.float32), "stop"))
    return t


def episode():
    first = context(0, [5, 6, 7], [[8, 9], [10]], [11, 12])
    second = context(0, [13, 14, 15, 16], [[17, 18, 19]], [])
    return first, second


def test_contexts_join_into_one_row_of_separate_sequences():
    first, second = episode()
    s = joined([first, second])
    assert s.prompt_ids == [5, 6, 7] and s.segments == [len(first.ids)]
    assert s.prompt_ids + s.completion_ids == first.ids + second.ids
    trained = [i for i, m in zip(s.completion_ids, s.completion_mask) if m]
    assert trained == [8, 9, 10, 17, 18, 19]  # each context's sampled ids, none of the second's prompt
    assert np.allclose(s.rollout_logprobs[np.asarray(s.completion_mask)], -0.5)
    batch = samples_to_batch([s, joined([first])], pad_id=0)
    positions = batch["position_ids"]
    assert positions[0, len(first.ids)] == 0 and positions[0, len(first.ids) - 1] == len(first.ids) - 1
    assert torch.equal(positions[1], torch.arange(positions.shape[1]))  # a row of one sequence counts on
    assert "position_ids" not in samples_to_batch([joined([first])], pad_id=0)  # no episode broke: as before
    assert torch.equal(segment_positions(6, [[2, 4]]), torch.tensor([[0, 1, 0, 1, 0, 1]]))
    from rollout.sources.queue import _sample_from_state, _sample_state
    assert _sample_from_state(_sample_state(s)).segments == s.segments  # generated ahead, kept across a resume


@pytest.mark.parametrize("path", ["padded", "packed", "shared prefix", "reference", "critic"])
def test_each_context_is_scored_as_if_alone(tiny_model_dir, path):
    from actors.critic import Critic
    from actors.policy import PolicyTrainer
    from actors.reference import ReferenceModel
    from rlhf.config import TrainerConfig

    first, second = episode()
    together = samples_to_batch([joined([first, second]), joined([second])], pad_id=0)
    alone = samples_to_batch([joined([first]), joined([second]), joined([second])], pad_id=0)
    tr = TrainerConfig(lr=1e-3, batch_size=2, micro_batch_size=2, warmup_steps=0)
    if path == "reference":
        score = ReferenceModel(tiny_model_dir).compute_logprobs
    elif path == "critic":
        score = Critic(tiny_model_dir, tr).compute_values
    else:
        tr = replace(tr, packing=path == "packed", shared_prefix=path == "shared prefix")
        score = PolicyTrainer(tiny_model_dir, tr).compute_logprobs
    # (what matters: the trained positions; a critic's value past a row's last token depends on the micro-batch)
    got, want = score(together) * together["loss_mask"], score(alone) * alone["loss_mask"]
    n1 = len(first.ids) - 1  # the first context's targets, then its last id predicting nothing of its own
    assert (got[0, :n1] - want[0, :n1]).abs().max() < 1e-5
    n2 = len(second.ids) - 1
    assert (got[0, n1 + 1:n1 + 1 + n2] - want[1, :n2]).abs().max() < 1e-5  # the second, from its own start
    w = want.shape[1]
    assert (got[1, :w] - want[2]).abs().max() < 1e-5 and not got[1, w:].any()  # the row beside it is untouched


def test_a_joined_row_trains_both_contexts(tiny_model_dir):
    from actors.policy import PolicyTrainer
    from rlhf.config import AlgorithmConfig, TrainerConfig

    first, second = episode()
    batch = samples_to_batch([joined([first, second])] * 2, pad_id=0)
    batch["advantages"] = torch.ones(batch["loss_mask"].shape) * batch["loss_mask"]
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(lr=1e-2, batch_size=2, micro_batch_size=2,
                                                          warmup_steps=0))
    before = trainer.compute_logprobs(batch)
    batch["old_logprobs"] = before
    trainer.rl_step(batch, AlgorithmConfig(name="grpo"))
    after = trainer.compute_logprobs(batch)
    gained = (after[0] - before[0])[batch["loss_mask"][0]]
    # a positive advantage raises each context's sampled ids (3 in each), the second's too
    assert gained[:3].sum() > 0 and gained[3:].sum() > 0, gained
