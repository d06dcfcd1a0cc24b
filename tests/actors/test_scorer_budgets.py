"""The scorers (reference, teacher, reward model, the critic's values) cut their micro-batches as the trainer
does: its row count or its padded-token budget, never a fixed 16 rows a long completion would not fit."""
from dataclasses import replace

import torch

from actors.critic import Critic
from actors.reference import ReferenceModel
from actors.reward_model import RewardModel
from rlhf.config import TrainerConfig, load_config
from tests.actors.batching.test_prefix_sharing import grouped_batch


def forward_sizes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(rows, width) of every forward of `model` from now on."""
    sizes = []
    model.register_forward_pre_hook(lambda m, args, kwargs: sizes.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)
    return sizes


def test_reference_reward_model_and_critic_keep_to_a_token_budget(tiny_model_dir):
    batch = grouped_batch(groups=4, size=4, vocab=200)  # rows of 6..20 tokens
    budget = 3 * int(batch["attention_mask"].sum(1).max())
    by_rows = ReferenceModel(tiny_model_dir, micro_batch_size=16).compute_logprobs(batch)
    reference = ReferenceModel(tiny_model_dir, max_tokens_per_micro_batch=budget)
    sizes = forward_sizes(reference.model)
    assert (reference.compute_logprobs(batch) - by_rows).abs().max() < 1e-5
    assert len(sizes) > 4 and all(rows * width <= budget for rows, width in sizes)

    rm = RewardModel(tiny_model_dir, max_tokens_per_micro_batch=budget)
    sizes = forward_sizes(rm.model)
    rm.score(batch)
    assert len(sizes) > 4 and all(rows * width <= budget for rows, width in sizes)

    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=16, warmup_steps=0)
    critic = Critic(tiny_model_dir, tr)
    budgeted = Critic(tiny_model_dir, replace(tr, max_tokens_per_micro_batch=budget))
    sizes = forward_sizes(budgeted.ds.module)
    values = budgeted.compute_values(batch) * batch["loss_mask"]
    assert (values - critic.compute_values(batch) * batch["loss_mask"]).abs().max() < 1e-5
    assert len(sizes) > 4 and all(rows * width <= budget for rows, width in sizes)


def test_the_run_hands_the_trainers_sizes_to_its_scorers(monkeypatch, tiny_model_dir):
    from rlhf.rl import startup
    made = {}

    class Record:
        def __init__(self, cls, role, options, *args, **kwargs):
            made[role] = kwargs
    import actors.group
    monkeypatch.setattr(actors.group, "Replicas", Record)
    cfg = load_config(None, ["algorithm.name=opd", f"teacher.path={tiny_model_dir}", "algorithm.kl_coef=0.1",
                             f"reward.model_path={tiny_model_dir}", "trainer.micro_batch_size=4",
                             "trainer.max_tokens_per_micro_batch=512"])
    options = type("P", (), {"options": {"reward": {}, "reference": {}, "teacher": {}}})()
    startup.start_scorers(cfg, tiny_model_dir, options, {"reward": 1, "reference": 1, "teacher": 1}, {})
    assert set(made) == {"reward model", "reference model", "teacher"}
    for kwargs in made.values():
        assert kwargs["micro_batch_size"] == 4 and kwargs["max_tokens_per_micro_batch"] == 512
