"""A single on-policy update (one epoch, one mini-batch) takes its old log-probs from the training forward itself:
the same update as with a separate log-prob pass, and `step_logprobs()` returns that pass's values in row order."""
import pytest
import torch

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
    a = separate.rl_step(dict(batch, old_logprobs=old, advantages=advantages), algo)
    b = fused.rl_step(dict(batch, advantages=advantages), algo)

    assert torch.allclose(fused.step_logprobs(), old, atol=1e-6)
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
    from actors.ds_model import deepspeed_config, zero3_loading

    init_deepspeed_distributed(0, 1, "127.0.0.1", None)
    for stage in (2, 3):
        with zero3_loading(deepspeed_config(TrainerConfig(batch_size=8, micro_batch_size=8, zero_stage=stage),
                                            "float32", 1)):
            model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert all(hasattr(p, "ds_id") for p in model.parameters()) == (stage == 3), stage
