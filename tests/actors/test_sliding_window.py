"""Sliding-window attention (Gemma-3: 5 of 6 layers; Qwen2 with use_sliding_window) is trained right by every
forward path of the trainer: padded, packed (trainer.packing) and shared-prefix (trainer.shared_prefix, whose 4D
mask would otherwise drop the window). Each path's log-probs are compared with transformers' own forward of each row
alone, on rows several times longer than the window so that the window binds."""
from dataclasses import replace

import pytest
import torch

from common.batch import pack_sequences

WINDOW = 4


def gemma3(path: str, impl: str) -> str:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           max_position_embeddings=128, attn_implementation=impl)
    Gemma3ForCausalLM(cfg).save_pretrained(path)
    return path


def qwen2(path: str, impl: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1, max_position_embeddings=128, attn_implementation=impl)
    assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def grpo_rows(groups=3, size=4, seed=0):
    """`groups` prompts of 5..8 tokens with `size` completions of 3..12 tokens each, right-padded in group order."""
    g = torch.Generator().manual_seed(seed)

    def tokens(lo, hi):
        return torch.randint(3, 300, (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist()

    prompts = [tokens(5, 9) for _ in range(groups)]
    return pack_sequences([p for p in prompts for _ in range(size)], [tokens(3, 13) for _ in range(groups * size)],
                          pad_id=0)


def alone_logprobs(path: str, batch) -> torch.Tensor:
    """transformers' forward of each row on its own (no padding, no packing): (B, W-1), zeros where untrained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, out = batch["input_ids"], torch.zeros(batch["loss_mask"].shape)
    with torch.no_grad():
        for b in range(len(ids)):
            n = int(batch["attention_mask"][b].sum())
            logp = model(input_ids=ids[b:b + 1, :n]).logits[0, :-1].float().log_softmax(-1)
            out[b, :n - 1] = logp.gather(-1, ids[b, 1:n, None])[:, 0]
    return out * batch["loss_mask"]


@pytest.mark.parametrize("arch,impl", [("gemma3", "sdpa"), ("gemma3", "eager"), ("qwen2", "sdpa")])
def test_every_forward_path_keeps_the_sliding_window(tmp_path, arch, impl):
    from actors.policy import PolicyTrainer
    from rlhf.config import TrainerConfig

    path = (gemma3 if arch == "gemma3" else qwen2)(str(tmp_path / arch), impl)
    batch = grpo_rows()
    assert int(batch["attention_mask"].sum(1).min()) >= 2 * WINDOW  # the window binds on every row
    want = alone_logprobs(path, batch)
    tr = TrainerConfig(lr=1e-3, batch_size=12, micro_batch_size=4, warmup_steps=0)
    for name, cfg in [("padded", tr), ("packed", replace(tr, packing=True)),
                      ("shared prefix", replace(tr, shared_prefix=True))]:
        got = PolicyTrainer(path, cfg).compute_logprobs(batch) * batch["loss_mask"]
        assert (got - want).abs().max() < 1e-4, f"{name}: {(got - want).abs().max():.3g} from transformers' own"


def test_the_shared_mask_windows_by_each_rows_own_positions():
    """Window 2: a continuation's token sees itself and the token before it in its own row: the prefix's last token
    for the continuation's first, never another continuation's tokens."""
    from actors.batching.prefix_sharing import layer_masks, plan_prefixes, share_prefixes

    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 9]])
    loss_mask = torch.tensor([[False, True, False], [False, True, True]])
    lay = share_prefixes(ids, plan_prefixes(ids, (ids != 0).long(), loss_mask))

    class Config:
        sliding_window, layer_types = 2, ["sliding_attention", "full_attention"]

    masks = layer_masks(lay, Config())
    assert masks["full_attention"].equal(lay.allowed)
    assert masks["sliding_attention"][0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                                               [1, 1, 0, 0, 0],
                                                               [0, 1, 1, 0, 0],   # row 0's 7: 6 and itself
                                                               [0, 1, 0, 1, 0],   # row 1's 8: 6 and itself
                                                               [0, 0, 0, 1, 1]]   # row 1's 9: 8 and itself
    Config.layer_types = None  # every layer windowed (Mistral)
    assert layer_masks(lay, Config()).equal(masks["sliding_attention"])
    Config.sliding_window = None
    assert layer_masks(lay, Config()).equal(lay.allowed)
