"""Fault handling in the trainer: a NaN/Inf loss skips the whole update (weights, optimizer moments and LR schedule
unchanged) under ZeRO 0 and 2; DeepSpeed checkpoints load without unpickling code; `BadStepGuard` counts skipped
steps and stops the run after too many in a row."""
import math
import os
import pickle

import pytest
import torch

from actors.policy import PolicyTrainer
from common.errors import TrainingStopped
from rlhf.config import AlgorithmConfig, TrainerConfig
from rlhf.stages.loop import BadStepGuard
from tests.actors.test_trainer_group import sft_batches


def snapshot(trainer: PolicyTrainer) -> tuple[dict, list]:
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moments = [v.clone() for s in trainer.ds._optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return weights, moments


def same(a: tuple[dict, list], b: tuple[dict, list]) -> bool:
    return all(torch.equal(a[0][n], b[0][n]) for n in a[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_non_finite_loss_skips_the_update(tiny_model_dir, zero_stage):
    batch = sft_batches(tiny_model_dir, steps=1)[0]
    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=8, warmup_steps=4, zero_stage=zero_stage)
    trainer, algo = PolicyTrainer(tiny_model_dir, tr), AlgorithmConfig(name="grpo")
    batch["old_logprobs"] = trainer.compute_logprobs(batch)
    good = dict(batch, advantages=batch["loss_mask"].float())
    first = trainer.rl_step(good, algo)  # a real update first, so the optimizer has moments to protect
    assert first["train/skipped_updates"] == 0 and first["train/lr"] == pytest.approx(0.5e-3)

    before = snapshot(trainer)
    poisoned = good["advantages"].clone()
    poisoned[5, :] = float("nan")  # one row of one micro-batch
    bad = trainer.rl_step(dict(good, advantages=poisoned), algo)
    assert bad["train/skipped_updates"] == 1 and not math.isfinite(bad["policy/loss"])
    assert same(before, snapshot(trainer))
    assert bad["train/lr"] == pytest.approx(0.5e-3)  # the warm-up did not advance either

    after = trainer.rl_step(good, algo)
    assert after["train/skipped_updates"] == 0 and after["train/lr"] == pytest.approx(0.75e-3)
    assert not same(before, snapshot(trainer))


class RunsCode:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_checkpoints_load_without_unpickling_code(tiny_model_dir, tmp_path):
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(batch_size=16, micro_batch_size=8, zero_stage=2))
    trainer.sft_step(sft_batches(tiny_model_dir, steps=1)[0])
    trainer.save_checkpoint(str(tmp_path))
    trainer.load_checkpoint(str(tmp_path))  # DeepSpeed's own ZeRO records pass the allowlist

    optim = [f for f in os.listdir(tmp_path / "policy") if f.endswith("optim_states.pt")]
    assert optim, os.listdir(tmp_path / "policy")
    marker = tmp_path / "code_ran"
    torch.save({"optimizer_state_dict": RunsCode(str(marker))}, tmp_path / "policy" / optim[0])
    with pytest.raises(pickle.UnpicklingError):
        trainer.load_checkpoint(str(tmp_path))
    assert not marker.exists()


def test_bad_step_guard_counts_and_stops():
    guard = BadStepGuard(max_bad_steps=2)
    rows = [{"train/skipped_updates": 0.0}, {"train/skipped_updates": 1.0}, {"critic/skipped_updates": 0.0},
            {"train/skipped_updates": 2.0}]
    for step, row in enumerate(rows, 1):
        guard.observe(row)
        guard.check(step, None)  # never two bad steps in a row yet
    assert [r["train/skipped_steps"] for r in rows] == [0.0, 1.0, 1.0, 2.0]

    resumed = BadStepGuard(max_bad_steps=2, state=guard.state())  # the count survives a resume
    row = {"critic/skipped_updates": 1.0}
    assert resumed.observe(row) and row["train/skipped_steps"] == 3.0
    with pytest.raises(TrainingStopped, match=r"steps 4\.\.5: 2 consecutive.*step_000003"):
        resumed.check(5, "runs/x/checkpoints/step_000003")
    assert BadStepGuard(max_bad_steps=0, state=resumed.state()).check(5, None) is None  # 0 = never stop
