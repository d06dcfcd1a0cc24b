"""trainer.shared_prefix (actors/batching/prefix_sharing.py): rows that share a prompt go through the model as one row,
the prompt once; the losses see the padded forward's outputs, and an update equals the padded one."""
from dataclasses import replace

import pytest
import torch

from actors.batching.prefix_sharing import gather_rows, group_unit, plan_prefixes, share_prefixes
from common.batch import pack_sequences


def plan_of(batch: dict):
    return plan_prefixes(*(batch[k] for k in ("input_ids", "attention_mask", "loss_mask")))


def grouped_batch(groups=4, size=4, vocab=300, seed=0):
    """`groups` prompts of 5..8 tokens, each with `size` completions of 1..12 tokens (right-padded rows in group
    order, as a rollout makes them)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(5, 9, (), generator=g)),), generator=g).tolist()
               for _ in range(groups)]
    completions = [torch.randint(3, vocab, (int(torch.randint(1, 13, (), generator=g)),), generator=g).tolist()
                   for _ in range(groups * size)]
    return pack_sequences([p for p in prompts for _ in range(size)], completions, pad_id=0)


def test_rows_sharing_a_prompt_become_one_row_with_each_continuation_seeing_the_prompt_and_itself():
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 9], [4, 6, 7, 0]])  # rows 0 and 1 share the prompt 5 6
    mask = (ids != 0).long()
    loss_mask = torch.tensor([[False, True, False], [False, True, True], [False, True, False]])
    lay = share_prefixes(ids, plan_prefixes(ids, mask, loss_mask))
    assert lay.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 6, 7, 0, 0]]
    assert lay.position_ids.tolist() == [[0, 1, 2, 2, 3], [0, 1, 2, 0, 0]]
    allowed = lay.allowed[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 1, 1, 0, 0],   # row 0's token 7
                       [1, 1, 0, 1, 0],   # row 1's tokens 8 9 see the prompt and themselves, not row 0's 7
                       [1, 1, 0, 1, 1]]
    assert lay.allowed[1, 0].int().tolist()[3] == [0, 0, 0, 1, 0]  # padding attends to itself only (no empty row)
    assert lay.source.tolist() == [[0, 1, 2, -1], [0, 1, 3, 4], [5, 6, 7, -1]]

    packed = torch.arange(10, dtype=torch.float32).view(2, 5, 1).requires_grad_()
    back = gather_rows(packed[:, 2:], lay, start=1)  # the forward kept the last 3 positions; columns 1.. wanted
    assert back[..., 0].tolist() == [[0, 2, 0], [0, 3, 4], [0, 7, 0]]  # column 1 = position 1: not kept, zero
    gather_rows(packed, lay)[:, 1].sum().backward()  # position 1 of the shared prompt is read by rows 0 and 1
    assert packed.grad[0, :, 0].tolist() == [0, 2, 0, 0, 0] and packed.grad[1, :, 0].tolist() == [0, 1, 0, 0, 0]


def test_group_unit_finds_contiguous_groups_only():
    batch = grouped_batch(groups=3, size=4)
    assert group_unit(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]) == 4
    shuffled = {k: v[torch.tensor([0, 4, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11])] for k, v in batch.items()}
    assert group_unit(shuffled["input_ids"], shuffled["attention_mask"], shuffled["loss_mask"]) == 1


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_shared_forward_gives_the_padded_logits_on_every_trained_position(tiny_model_dir, impl):
    from transformers import AutoModelForCausalLM

    from actors.batching.prefix_sharing import additive_mask

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=impl).eval()
    batch = grouped_batch()
    lay = share_prefixes(batch["input_ids"], plan_of(batch))
    assert lay.input_ids.shape[0] == 4 and lay.input_ids.numel() < batch["attention_mask"].sum()
    mask = lay.allowed if impl == "sdpa" else additive_mask(lay.allowed, torch.float32)
    out = model(input_ids=lay.input_ids, attention_mask=mask, position_ids=lay.position_ids, use_cache=False)
    got = gather_rows(out.logits, lay)
    padded = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    trained = torch.nn.functional.pad(batch["loss_mask"], (0, 1))  # the logits that predict trained tokens
    assert torch.allclose(got[trained], padded[trained], atol=1e-5)


def test_a_shared_prefix_update_equals_the_padded_one(tiny_model_dir):
    """GRPO-shaped rows (4 prompts x 4 samples): with shared_prefix each micro-batch keeps whole groups, computes
    each prompt once, and the update (loss, gradient norm, metrics) and log-probs equal the padded ones."""
    from actors.critic import Critic
    from actors.policy import PolicyTrainer
    from rlhf.config import AlgorithmConfig, TrainerConfig

    batch = grouped_batch()
    advantages = torch.randn(16, 1, generator=torch.Generator().manual_seed(1)) * batch["loss_mask"]
    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=8, warmup_steps=0)
    padded, shared = PolicyTrainer(tiny_model_dir, tr), PolicyTrainer(tiny_model_dir, replace(tr, shared_prefix=True))
    groups = [sorted((rows // 4).unique().tolist()) for rows, _ in shared.ds._micro_batches(batch, 1)]
    assert all(len(g) == 2 for g in groups) and sorted(sum(groups, [])) == [0, 1, 2, 3]  # whole groups
    old = padded.compute_logprobs(batch)
    assert torch.allclose(shared.compute_logprobs(batch), old, atol=1e-5)
    old = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2)) * batch["loss_mask"]
    a, b = [t.rl_step(dict(batch, old_logprobs=old, advantages=advantages), AlgorithmConfig())
            for t in (padded, shared)]
    for key in ("policy/loss", "train/grad_norm", "policy/entropy", "policy/clip_frac"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key

    critics = [Critic(tiny_model_dir, c) for c in (tr, replace(tr, shared_prefix=True))]
    values = [c.compute_values(batch) * batch["loss_mask"] for c in critics]
    assert torch.allclose(values[1], values[0], atol=1e-5)


def test_a_dpo_pair_shares_its_prompt_and_the_dpo_update_is_unchanged(tiny_model_dir):
    """Interleaved preference pairs (common.batch.pack_pairs): chosen and rejected share the prompt, so each pair is
    one row under shared_prefix; the DPO loss, its metrics and the gradient norm equal the padded update's."""
    from actors.policy import PolicyTrainer
    from common.batch import pack_pairs
    from rlhf.config import AlgorithmConfig, TrainerConfig

    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (24,), generator=g)]
    batch = pack_pairs(tokens[:8], tokens[8:16], tokens[16:], pad_id=0)
    lay = share_prefixes(batch["input_ids"], plan_of(batch))
    assert lay.input_ids.shape[0] == 8  # one row a pair
    batch["ref_logps"] = -torch.rand(16, generator=g) * 20
    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=4, warmup_steps=0)
    a, b = [PolicyTrainer(tiny_model_dir, c).dpo_step(dict(batch), AlgorithmConfig())
            for c in (tr, replace(tr, shared_prefix=True))]
    for key in ("train/loss", "train/grad_norm", "dpo/reward_margin"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_sharing_is_chosen_only_where_it_costs_less_than_padding():
    """The cost model behind the fall-back: prompt-heavy groups share (the real-model recipe's 57-token prompt and 4
    samples of ~30 tokens), long continuations and groups of one take the padded forward, and so does a mask
    over its byte budget."""
    from actors.batching.prefix_sharing import ForwardCost

    cost = ForwardCost(token_flops=2 * 100e6, attention_flops=4 * 576 * 30, mask_bytes=2)  # SmolLM2-135M's shape

    def rows(prompt: int, completion: int, groups: int, size: int):
        prompts = [[7 + g] * prompt for g in range(groups) for _ in range(size)]
        return pack_sequences(prompts, [[9] * completion] * (groups * size), pad_id=0)

    def pays(b, **kw) -> bool:
        return cost.sharing_pays(plan_of(b), **kw)
    assert pays(rows(57, 30, groups=4, size=4))
    assert not pays(rows(64, 1024, groups=1, size=8))  # 8 x 1k in one row: 8^2 the pairs of a padded row
    assert not pays(rows(57, 30, groups=4, size=1))  # nothing to share
    assert not pays(rows(57, 30, groups=4, size=4), max_mask_bytes=1000)


def test_a_micro_batch_that_sharing_would_slow_takes_the_padded_forward(tiny_model_dir, monkeypatch):
    from actors.ds_model import DSModel
    from actors.policy import PolicyTrainer
    from rlhf.config import TrainerConfig

    tr = TrainerConfig(lr=1e-3, batch_size=16, micro_batch_size=8, warmup_steps=0, shared_prefix=True)
    trainer, padded = PolicyTrainer(tiny_model_dir, tr), PolicyTrainer(tiny_model_dir, replace(tr, shared_prefix=False))
    calls = []
    shared = DSModel._shared_forward
    monkeypatch.setattr(DSModel, "_shared_forward", lambda self, mb, plan: calls.append(1) or shared(self, mb, plan))
    short, long = grouped_batch(vocab=200), pack_sequences([[5] * 6] * 16, [[9] * 60] * 16, pad_id=0)
    trainer.compute_logprobs(short)
    assert len(calls) == 2  # both micro-batches shared their prompts
    got = trainer.compute_logprobs(long)  # one 6-token prompt under 16 continuations of 60: padding is cheaper
    assert len(calls) == 2 and torch.allclose(got, padded.compute_logprobs(long), atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_on_cuda_the_packed_width_is_a_multiple_of_16_and_the_padding_changes_no_log_prob(seed, tiny_model_dir):
    """CUDA's memory-efficient attention copies a mask whose rows are not 16-aligned in every layer (and keeps the
    copies for the backward): the layout planned for CUDA is aligned, and its extra positions are padding that no
    row reads."""
    from transformers import AutoModelForCausalLM

    from actors.batching.prefix_sharing import mask_align
    batch = grouped_batch(seed=seed, vocab=200)
    args = [batch[k] for k in ("input_ids", "attention_mask", "loss_mask")]
    assert mask_align(torch.device("cuda")) == 16 and mask_align(torch.device("cpu")) == 1
    exact, aligned = plan_prefixes(*args), plan_prefixes(*args, align=16)
    assert aligned.width % 16 == 0 and exact.width <= aligned.width < exact.width + 16
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    got = []
    for plan in (exact, aligned):
        lay = share_prefixes(batch["input_ids"], plan)
        out = model(input_ids=lay.input_ids, attention_mask=lay.allowed, position_ids=lay.position_ids, use_cache=False)
        got.append(gather_rows(out.logits, lay))
    trained = torch.nn.functional.pad(batch["loss_mask"], (0, 1))
    assert torch.allclose(got[0][trained], got[1][trained], atol=1e-5)
