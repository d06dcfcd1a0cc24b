"""The rollout phase's parts that are not the controller's: one round's result (`Round`), the engines' GPU memory
over a step's rounds (`EngineMemory`), and the choice of groups across rounds (`select_groups`)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from algorithms.advantages import choose_groups
from common.batch import samples_to_batch


@dataclass
class Round:
    """One rollout round: the rows drawn, their samples (n_samples a row, adjacent), the padded batch, each
    sample's reward, the round's metrics, and which of its groups have rewards that differ."""
    rows: list[dict]
    samples: list
    batch: dict
    scores: torch.Tensor
    metrics: dict
    signal: torch.Tensor  # (groups,) bool


class EngineMemory:
    """GPU colocation: the engines are awake for a step's rollout rounds and asleep again once nothing more will be
    generated (`release`, or leaving the block), so the reward and reference models and the trainers get the GPU.
    Under rollout.overlap they never sleep: a generation is always in flight."""

    def __init__(self, rollout, asleep_between_steps: bool):
        self.rollout, self.active, self.awake = rollout, asleep_between_steps, False

    def __enter__(self) -> "EngineMemory":
        if self.active:
            self.rollout.wake_up()
            self.awake = True
        return self

    def release(self) -> None:
        if self.awake:
            self.rollout.sleep()
            self.awake = False

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.release()


def select_groups(rounds: list[Round], want: int, n: int, pad_id: int):
    """The first `want` groups with signal across the rounds (n samples a group), topped up with all-equal ones:
    (samples, batch, rewards, metrics), the metrics the last round's with the selection's."""
    groups = [r.samples[g * n:(g + 1) * n] for r in rounds for g in range(len(r.samples) // n)]
    signal = torch.cat([r.signal for r in rounds])
    chosen = choose_groups(signal, want).tolist()
    samples = [replace(s, prompt_index=i) for i, g in enumerate(chosen) for s in groups[g]]
    rewards = torch.cat([r.scores.view(-1, n) for r in rounds])[chosen].flatten()
    metrics = {**rounds[-1].metrics, "rollout/kept_group_frac": min(int(signal.sum()), want) / want,
               "rollout/informative_frac": signal.float().mean().item(), "rollout/fill_rounds": len(rounds)}
    return samples, samples_to_batch(samples, pad_id), rewards, metrics
