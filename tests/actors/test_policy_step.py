"""A single on-policy update (one epoch, one mini-batch) takes its old log-probs from the training forward itself:
the same update as with a separate log-prob pass; either way the update reports the rollout's log-prob drift and KL
from the old log-probs it holds (an engine off by a constant on every token shows as exactly that constant)."""
import math
from dataclasses import replace

import pytest
import torch

from actors.ds_model import PackedOutput
from actors.policy import PolicyTrainer
from rlhf.config import AlgorithmConfig, TrainerConfig
from tests.actors.test_trainer_group import sft_batches


def test_fused_old_logprobs_give_the_same_update(tiny_model_dir):
    batch = sft_batches(tiny_model_dir, steps=1)[0]
    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=8, warmup_steps=0)
    separate, fused, algo = PolicyTrainer(tiny_model_dir, tr), PolicyTrainer(tiny_model_dir, tr), AlgorithmConfig()
    advantages = torch.randn(len(batch["input_ids"]), 1, generator=torch.Generator().manual_seed(0)) \
        * batch["loss_mask"]
    old = separate.compute_logprobs(batch)
    # an engine 0.25 nats off on every sampled token, and a reference 0.5 off: the update measures both drifts
    mask = batch["loss_mask"]
    rollout, ref = (old + 0.25) * mask, (old - 0.5) * mask
    a = separate.rl_step(dict(batch, old_logprobs=old, advantages=advantages, rollout_logprobs=rollout,
                              ref_logprobs=ref), algo)
    b = fused.train_step(dict(batch, rollout_logprobs=rollout, ref_logprobs=ref), algo,
                         extra={"advantages": advantages})  # the step's extra tensors, merged by the worker

    for m in (a, b):
        assert m["rollout/logprob_diff"] == pytest.approx(0.25, abs=1e-5)
        assert m["rollout/kl"] == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-5)  # k3 at ref - old = -0.5
    assert b["policy/loss"] == pytest.approx(a["policy/loss"], abs=1e-6)
    for (name, p), q in zip(separate.model.named_parameters(), fused.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6), name
    assert not torch.equal(old, fused.compute_logprobs(batch))  # the update did happen

    with pytest.raises(ValueError, match="ppo_epochs == 1"):
        fused.rl_step(dict(batch, advantages=advantages), AlgorithmConfig(ppo_epochs=2))


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_offloading_between_steps_changes_nothing(tiny_model_dir, zero_stage):
    """trainer.offload: DeepSpeed's states leave and come back between phases; training and export are unchanged.
    (On CPU they only move CPU to CPU, but DeepSpeed still unlinks and relinks every parameter and state.)"""
    batches = sft_batches(tiny_model_dir, steps=2)
    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=8, warmup_steps=0, zero_stage=zero_stage)
    plain, offloaded = PolicyTrainer(tiny_model_dir, tr), PolicyTrainer(tiny_model_dir, tr)
    for batch in batches:
        offloaded.offload()
        assert offloaded.ds.offloaded and offloaded.ds.engine.optimizer.offloaded_states
        a, b = plain.sft_step(batch), offloaded.sft_step(batch)  # the forward reloads first
        assert not offloaded.ds.offloaded and not offloaded.ds.engine.optimizer.offloaded_states
        assert b["train/loss"] == a["train/loss"] and b["train/grad_norm"] == a["train/grad_norm"]
    offloaded.offload()
    exported = dict(offloaded.export_weights())  # export reloads too
    for name, w in plain.export_weights():
        assert torch.equal(exported[name], w), name


def test_zero3_builds_the_model_in_shards(tiny_model_dir):
    """Under ZeRO-3 `from_pretrained` runs inside deepspeed.zero.Init (each rank allocates only its shard; a
    parameter is then a ZeRO-3 one, `ds_id`, before deepspeed.initialize); other stages load plainly."""
    from transformers import AutoModelForCausalLM

    from actors.dist import init_deepspeed_distributed
    from actors.ds_guards import zero3_loading
    from actors.ds_config import deepspeed_config

    init_deepspeed_distributed(0, 1, "127.0.0.1", None)
    for stage in (2, 3):
        with zero3_loading(deepspeed_config(TrainerConfig(batch_size=8, micro_batch_size=8, zero_stage=stage),
                                            "float32", 1)):
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert all(hasattr(p, "ds_id") for p in model.parameters()) == (stage == 3), stage


def test_deepspeed_on_cpu_starts_without_compiling_its_shared_memory_op():
    """DeepSpeed's CPU backend would compile `deepspeed_shm_comm` (41 s, 64 CPU-s of g++ on a new machine) for an
    all-reduce only its inference tensor parallelism uses; the trainers' process group starts without it and still
    reduces."""
    import deepspeed
    import torch

    from actors.dist import init_deepspeed_distributed

    init_deepspeed_distributed(0, 1, "127.0.0.1", None)
    assert deepspeed.comm.comm.cdb.shm_comm_op is None
    x = torch.ones(3)
    deepspeed.comm.all_reduce(x)
    assert x.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("agg", ["seq-mean-token-sum-norm", "seq-mean-token-mean", "token-mean"])
def test_the_update_does_not_depend_on_the_micro_batch_split(tiny_model_dir, agg):
    """The same rows give the same update whether trained as one micro-batch of 16, as four of 4 (each cut to its
    own longest row by length grouping), by a token budget (trainer.max_tokens_per_micro_batch), or packed
    without padding (trainer.packing: rows end to end, position ids restarting per row). Dr. GRPO's
    seq-mean-token-sum-norm divides by a constant (the generation budget), not by a micro-batch's width, which
    differs between the splits."""
    batch = sft_batches(tiny_model_dir, steps=1)[0]
    # very uneven answer lengths: keep only each row's first 1..16 answer tokens in the loss
    first = batch["loss_mask"].float().argmax(-1)
    keep = torch.arange(batch["loss_mask"].shape[1])[None] < (first + 1 + torch.arange(16))[:, None]
    batch["loss_mask"] = batch["loss_mask"] & keep
    advantages = torch.randn(len(batch["input_ids"]), 1, generator=torch.Generator().manual_seed(0)) \
        * batch["loss_mask"]
    algo = AlgorithmConfig(loss_agg=agg, loss_norm_len=32)
    longest = int(batch["attention_mask"].sum(1).max())
    configs = [TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=m, warmup_steps=0) for m in (16, 4)]
    # micro-batches by padded tokens: as many rows as fit 3 of the longest, so their row counts differ
    configs.append(TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=16, warmup_steps=0,
                                 max_tokens_per_micro_batch=3 * longest))
    configs += [TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=m, warmup_steps=0, packing=True)
                for m in (16, 4)]
    trainers = [PolicyTrainer(tiny_model_dir, c) for c in configs]
    assert isinstance(trainers[3].ds._forward(batch), PackedOutput)
    assert not isinstance(trainers[0].ds._forward(batch), PackedOutput)
    sizes = [len(rows) for rows, _ in trainers[2].ds._micro_batches(batch, 1)]
    assert sum(sizes) == 16 and sizes[0] <= 3 and len(set(sizes)) > 1, sizes
    # off-policy old log-probs: ratios and clipping vary token by token, so a wrongly weighted metric shows
    old = trainers[0].compute_logprobs(batch) + 0.3 * torch.randn(batch["loss_mask"].shape,
                                                                  generator=torch.Generator().manual_seed(1))
    whole, *splits = [t.rl_step(dict(batch, old_logprobs=old, advantages=advantages), algo) for t in trainers]
    for split in splits:
        # (not the weights: AdamW's first step is lr * sign(g), which turns rounding in ~0 gradients into lr)
        assert split["policy/loss"] == pytest.approx(whole["policy/loss"], rel=1e-5)
        assert split["train/grad_norm"] == pytest.approx(whole["train/grad_norm"], rel=1e-5)
        # metrics too: weighted by the loss's unit (tokens for token-mean, else rows), not a plain mean
        for key in ("policy/entropy", "policy/clip_frac", "policy/ratio_mean"):
            assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key


def test_rows_with_nothing_to_train_can_fill_a_micro_batch(tiny_model_dir):
    """An agent or environment that failed before the model's first turn leaves a one-token row that trains nothing
    (rollout.agents.episode); length grouping puts such rows in a micro-batch of their own, whose loss must still
    reach the graph for DeepSpeed's backward. The update is the one without them (token-mean)."""
    batch = sft_batches(tiny_model_dir, steps=1)[0]
    for key in ("input_ids", "attention_mask", "loss_mask"):
        batch[key][12:] = 0
    batch["attention_mask"][12:, 0] = 1
    advantages = torch.randn(16, 1, generator=torch.Generator().manual_seed(0)) * batch["loss_mask"]
    results = []
    for rows in (16, 12):
        trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(lr=1e-3, batch_size=rows, micro_batch_size=4,
                                                              warmup_steps=0))
        part = {k: v[:rows] for k, v in batch.items()}
        old = trainer.compute_logprobs(part)
        results.append(trainer.rl_step(dict(part, old_logprobs=old, advantages=advantages[:rows]), AlgorithmConfig()))
    assert results[0]["train/skipped_updates"] == 0
    assert results[0]["train/grad_norm"] == pytest.approx(results[1]["train/grad_norm"], rel=1e-5)


def test_ppo_epochs_reshuffle_the_mini_batches(tiny_model_dir):
    """Two epochs over 16 rows in mini-batches of 8: each epoch's mini-batches cover every row once; the first keeps
    the rollout's order (prompt groups whole), the second groups the rows differently (a fixed split would repeat
    the same gradient steps)."""
    batch = sft_batches(tiny_model_dir, steps=1)[0]
    trainer = PolicyTrainer(tiny_model_dir, TrainerConfig(lr=1e-4, batch_size=8, micro_batch_size=8,
                                                          warmup_steps=0))
    seen, step = [], trainer.ds.optimizer_step
    trainer.ds.optimizer_step = lambda mini, *a, **k: seen.append(sorted(mini["tag"].tolist())) or step(mini, *a, **k)
    batch = dict(batch, old_logprobs=trainer.compute_logprobs(batch), advantages=batch["loss_mask"].float(),
                 tag=torch.arange(16))
    trainer.rl_step(batch, AlgorithmConfig(ppo_epochs=2))
    assert len(seen) == 4
    for epoch in (seen[:2], seen[2:]):
        assert sorted(epoch[0] + epoch[1]) == list(range(16))
    assert seen[:2] == [list(range(8)), list(range(8, 16))]
    assert sorted(map(tuple, seen[:2])) != sorted(map(tuple, seen[2:]))


def test_a_packed_critic_gives_the_padded_values_and_update(tiny_model_dir):
    """trainer.packing applies to the critic's value head too (one value a token): the same values and value loss."""
    from actors.critic import Critic

    batch = sft_batches(tiny_model_dir, steps=1)[0]
    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=8, warmup_steps=0)
    padded, packed = Critic(tiny_model_dir, tr), Critic(tiny_model_dir, replace(tr, packing=True))
    values, mask = padded.compute_values(batch), batch["loss_mask"]
    assert torch.allclose(packed.compute_values(batch) * mask, values * mask, atol=1e-5)  # padding: 0, unused
    rows = dict(batch, old_values=values, returns=torch.randn(values.shape, generator=torch.Generator().manual_seed(0)))
    a, b = padded.value_step(rows, AlgorithmConfig()), packed.value_step(rows, AlgorithmConfig())
    assert b["critic/loss"] == pytest.approx(a["critic/loss"], rel=1e-5)
    assert b["critic/grad_norm"] == pytest.approx(a["critic/grad_norm"], rel=1e-5)
