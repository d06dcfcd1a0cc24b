"""Logits only from a micro-batch's first trained position (actors.logits): the forward returns fewer positions,
and every number the losses and scorers produce is the one the full logits give."""
import pytest
import torch

from actors.policy import PolicyTrainer
from actors.reference import ReferenceModel
from common.batch import first_target
from rlhf.config import AlgorithmConfig, TrainerConfig
from tests.actors.test_trainer_group import sft_batches


def test_first_target_is_the_first_column_any_row_trains_on():
    mask = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert first_target(mask) == 2
    assert first_target(torch.zeros(2, 4, dtype=torch.bool)) == 0


def test_trimmed_logits_give_the_same_logprobs_updates_and_metrics(tiny_model_dir):
    batch = sft_batches(tiny_model_dir, steps=1)[0]
    mask, width = batch["loss_mask"], batch["input_ids"].shape[1]
    start = first_target(mask)
    assert start > 0  # the prompts are long enough for the check below to mean something
    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=8, warmup_steps=0, chunked_logprobs=False)
    trimmed, full = PolicyTrainer(tiny_model_dir, tr), PolicyTrainer(tiny_model_dir, tr)
    full.ds.trims_logits = False  # the reference: logits for every position
    assert trimmed.ds.trims_logits
    assert trimmed.ds(batch).logits.shape[1] == width - start and full.ds(batch).logits.shape[1] == width

    logprobs = full.compute_logprobs(batch)
    got = trimmed.compute_logprobs(batch)
    assert torch.allclose(got[mask], logprobs[mask], atol=1e-6) and not got[~mask].any()
    ref = ReferenceModel(tiny_model_dir).compute_logprobs(batch)
    assert torch.allclose(ref[mask], logprobs[mask], atol=1e-6)

    advantages = torch.randn(len(mask), 1, generator=torch.Generator().manual_seed(0)) * mask
    old = logprobs + 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    rows = dict(batch, old_logprobs=old, ref_logprobs=ref, advantages=advantages)
    algo = AlgorithmConfig(kl_coef=0.1, kl_in_reward=False)
    a, b = full.rl_step(rows, algo), trimmed.rl_step(rows, algo)
    for key in ("policy/loss", "train/grad_norm", "policy/entropy", "policy/kl", "policy/clip_frac"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    a, b = full.sft_step(batch), trimmed.sft_step(batch)
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
