"""Ulysses sequence parallelism (trainer.sequence_parallel_size): two gloo ranks, each holding half of every
sequence, compute the per-token log-probs, the loss, the gradient and the update one process computes on whole
sequences. Widths that do not divide by two (the split pads them), rows of different lengths, the deferred head, a
token budget and gradient checkpointing all go through the split."""
from dataclasses import replace

import pytest
import torch

from actors.policy import PolicyTrainer
from actors.sequence_parallel import refusal
from common.batch import pack_sequences
from rlhf.config import AlgorithmConfig, TrainerConfig

TR = TrainerConfig(lr=1e-3, batch_size=4, micro_batch_size=2, warmup_steps=0, chunked_logprobs=True)


def rows(seed: int) -> dict:
    """4 right-padded rows of different lengths, an odd width (the split pads it to an even one)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (7, 9, 8, 6)]
    completions = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (20, 5, 13, 31)]
    batch = pack_sequences(prompts, completions, pad_id=0)
    assert batch["input_ids"].shape[1] % 2 == 1
    batch["advantages"] = torch.where(batch["loss_mask"], torch.linspace(-1, 1, 4)[:, None], 0.0)
    return batch


def record_widths(trainer) -> None:
    """The token widths the decoder's embedding sees on this rank."""
    trainer.widths = []
    embed = trainer.ds.module.get_input_embeddings()
    embed.register_forward_pre_hook(lambda module, args: trainer.widths.append(args[0].shape[1]))


def assert_one_update(group, single, batch: dict, got: torch.Tensor) -> None:
    """The group's log-probs `got`, then its update, equal the single process's on the whole batch."""
    algo = AlgorithmConfig()
    assert (got - single.compute_logprobs(batch)).abs().max() < 1e-5
    metrics, expected = group.train_step(batch, algo), single.train_step(batch, algo)
    assert metrics["policy/loss"] == pytest.approx(expected["policy/loss"], rel=1e-5, abs=1e-7)
    assert metrics["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
    weights = dict(group.export_weights())
    for name, w in single.iter_weights():
        assert torch.allclose(weights[name], w, atol=1e-5, rtol=0), (name, (weights[name] - w).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"zero_stage": 3},  # (ZeRO-3 reduces gradients its own way)
                                   {"zero_stage": 2, "gradient_checkpointing": True, "max_tokens_per_micro_batch": 80}])
def test_two_sequence_parallel_ranks_compute_what_one_process_does(ray_local, tiny_model_dir, extra):
    from actors.group import ActorGroup

    tr = replace(TR, **extra)
    single = PolicyTrainer(tiny_model_dir, replace(tr, zero_stage=0))
    group = ActorGroup(PolicyTrainer, "policy trainer", 2, sequence_parallel=2, model_path=tiny_model_dir,
                       tr=replace(tr, world_size=2, sequence_parallel_size=2))
    try:
        ray_local.get([a.__ray_call__.remote(record_widths) for a in group.actors], timeout=60)
        for seed in (0, 1):  # two updates: the second from weights both moved
            batch = rows(seed)
            got = group.compute_logprobs(batch)
            assert got.shape == batch["loss_mask"].shape
            seen = ray_local.get([a.__ray_call__.remote(lambda t: t.widths) for a in group.actors], timeout=60)
            assert seen[0] == seen[1] and max(seen[0]) == (batch["input_ids"].shape[1] + 1) // 2  # half each
            assert_one_update(group, single, batch, got)
    finally:
        group.kill()


def test_a_model_whose_heads_do_not_split_is_refused_with_the_reason():
    from types import SimpleNamespace
    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)  # SmolLM2-135M
    assert "9 attention heads do not split over 2 ranks" in refusal(smollm2, None, 2)
    assert refusal(smollm2, None, 3) is None
    assert "eager" in refusal(smollm2, "eager", 3)
    gemma = SimpleNamespace(num_attention_heads=4, num_key_value_heads=1, sliding_window=512,
                            layer_types=["sliding_attention", "full_attention"])
    assert "sliding window" in refusal(gemma, None, 2)
    qwen = SimpleNamespace(num_attention_heads=14, num_key_value_heads=2, sliding_window=4096,
                           use_sliding_window=False)
    assert refusal(qwen, None, 2) is None


@pytest.mark.slow
def test_two_sequence_parallel_groups_one_with_nothing_to_train_match_one_process(ray_local, tiny_model_dir):
    """Four ranks: 2 data-parallel groups x 2 sequence-parallel ranks, under ZeRO-3 (every parameter gathered in each
    forward, so every rank must run as many). The first group's rows are short and train nothing (their loss mask
    is empty), the second's are long: every all-to-all and gather still runs as often on every rank, the run
    finishes, and the update is the one process's."""
    from actors.group import ActorGroup

    tr = replace(TR, zero_stage=3)
    batch = rows(2)
    batch["loss_mask"][:2] = False  # the first data-parallel group's two rows
    batch["advantages"] = torch.where(batch["loss_mask"], batch["advantages"], 0.0)
    single = PolicyTrainer(tiny_model_dir, replace(tr, zero_stage=0))
    group = ActorGroup(PolicyTrainer, "policy trainer", 4, sequence_parallel=2, model_path=tiny_model_dir,
                       tr=replace(tr, world_size=4, sequence_parallel_size=2))
    try:
        assert_one_update(group, single, batch, group.compute_logprobs(batch))
    finally:
        group.kill()
