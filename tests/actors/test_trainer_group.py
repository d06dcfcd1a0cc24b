"""A 2-rank ZeRO-3 policy group in Ray trains exactly like a single-process fp32 reference; a dead rank is named."""
import pytest
import torch

from actors.batching.packing import deal_by_length
from actors.group import ActorGroup
from algorithms.sft import sft_loss
from common.remote import WorkerDied
from rlhf.config import DataConfig, TrainerConfig
from rlhf.stages.sft import tokenize_sft
from rlhf.stages.tasks import make_rows
from rollout.render import PromptRenderer

LR = 1e-3  # AdamW amplifies reduction-order rounding on near-zero grads: ~1.5e-6 here, ~1.5e-5 at 1e-2


def sft_batches(model_dir, steps=3, rows=16):
    renderer = PromptRenderer.from_pretrained(model_dir)
    data = make_rows(DataConfig(task="sort", num_train=rows * steps), "train", seed=1)
    return [tokenize_sft(renderer, data[i * rows:(i + 1) * rows]) for i in range(steps)]


def reference_weights(model_dir, batches, grad_clip):
    """Plain PyTorch: whole-batch token-mean SFT loss, clip, AdamW. No DeepSpeed, no Ray."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for b in batches:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        loss, _ = sft_loss(logits[:, :-1], b["input_ids"][:, 1:], b["loss_mask"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters(remove_duplicate=False))


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage,budget", [(3, None), (3, 50)])  # 50: the ranks need 6 and 7, 7 and 6, ...
def test_two_rank_zero_group_matches_single_process_reference(ray_local, tiny_model_dir, zero_stage, budget):
    """Two ZeRO ranks train like one process; with a token budget per micro-batch too, where the ranks' rows need
    different numbers of micro-batches and must agree on one (ZeRO-3 gathers once per micro-batch)."""
    from actors.policy import PolicyTrainer

    batches = sft_batches(tiny_model_dir)
    tr = TrainerConfig(lr=LR, batch_size=16, micro_batch_size=4, warmup_steps=0, zero_stage=zero_stage,
                       grad_clip=1.0, max_tokens_per_micro_batch=budget)
    group = ActorGroup(PolicyTrainer, "policy trainer", 2, model_path=tiny_model_dir, tr=tr)
    try:
        initial = dict(group.export_weights())
        for b in batches:
            metrics = group.train_step(b)
            assert metrics["train/grad_norm"] > 0
        trained = dict(group.export_weights())
        expected = reference_weights(tiny_model_dir, batches, tr.grad_clip)
        assert set(trained) == set(expected)
        for name, ref in expected.items():
            assert not torch.equal(trained[name], initial[name]) or "norm" in name, name
            assert torch.allclose(trained[name], ref.detach(), atol=1e-5, rtol=0), \
                (name, (trained[name] - ref).abs().max().item())

        ray_local.kill(group.actors[1])  # a rank dies: the error names it, rather than hanging
        with pytest.raises(WorkerDied, match="policy trainer 1 died"):
            group.compute_logprobs(batches[0])
    finally:
        group.kill()


def test_reference_copies_score_like_one(tiny_model_dir, ray_local):
    """Replicas split the rows (5 over 2 copies: 2 + 3) and concatenate in order: the same log-probs, on every real
    token, as one model scoring every row in-process; a batch shipped in one shard per copy (common.remote.ship)
    is scored from its references, the same, and one shipped otherwise from the driver's rows."""
    from actors.group import Replicas
    from actors.reference import ReferenceModel
    from common.batch import pack_sequences
    from common.remote import ship

    batch = pack_sequences([[20, 21, 22]] * 5, [[5, 6], [5, 6, 7, 8, 9], [5], [7, 8, 9], [9, 9]], pad_id=0)
    four = {k: v[:4] for k, v in batch.items()}
    copies = Replicas(ReferenceModel, "reference model", [{}, {}], tiny_model_dir)
    try:
        copies.ready()
        split = copies.compute_logprobs(batch)
        shipped = copies.compute_logprobs(ship(four, 2))
        elsewise = copies.compute_logprobs(ship(four, 4))  # four shards for two copies: cut from the driver's rows
    finally:
        copies.kill()
    whole = ReferenceModel(tiny_model_dir).compute_logprobs(batch)
    assert split.shape == whole.shape == (5, batch["input_ids"].shape[1] - 1)
    real = batch["attention_mask"][:, 1:].bool()  # past a row's end the values are padding
    assert torch.allclose(split[real], whole[real], atol=1e-6)
    assert torch.equal(shipped, split[:4]) and torch.equal(elsewise, split[:4])


@pytest.mark.slow
def test_rows_dealt_to_ranks_by_length_come_back_in_row_order(ray_local, tiny_model_dir):
    """Token-budget training deals each mini-batch's rows to the ranks by length, also for a shipped batch with
    its extra tensors: each rank's fused old log-probs then match the engine log-probs dealt with them (the
    update's rollout/logprob_diff, computed on the ranks, is 0 only if every row met its own)."""
    from actors.policy import PolicyTrainer
    from rlhf.config import AlgorithmConfig

    batch = sft_batches(tiny_model_dir, steps=1)[0]
    tr = TrainerConfig(lr=LR, batch_size=16, micro_batch_size=8, warmup_steps=0, max_tokens_per_micro_batch=64)
    group = ActorGroup(PolicyTrainer, "policy trainer", 2, model_path=tiny_model_dir, tr=tr)
    try:
        rows = group.ship(batch)
        old = group.compute_logprobs(rows)
        assert torch.equal(old, group.compute_logprobs(batch))
        advantages = torch.randn(16, 1, generator=torch.Generator().manual_seed(0)) * batch["loss_mask"]
        order = deal_by_length(batch["attention_mask"].sum(1), 2, 1)
        assert not torch.equal(order, torch.arange(16))  # the rows are dealt, not cut in halves

        def update(engine_logprobs: torch.Tensor) -> dict:
            return group.train_step(group.ship(dict(batch, rollout_logprobs=engine_logprobs)), AlgorithmConfig(),
                                    mini_batches=1, extra={"advantages": advantages})
        assert update(old.roll(1, 0))["rollout/logprob_diff"] > 1e-2  # a row meeting another's log-probs shows
        now = group.compute_logprobs(rows)  # (that update moved the weights)
        metrics = update(now)
        assert metrics["rollout/logprob_diff"] < 1e-6 and metrics["train/grad_norm"] > 0
    finally:
        group.kill()
