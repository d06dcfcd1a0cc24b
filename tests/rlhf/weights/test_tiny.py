"""The tiny-model kit: a Hugging Face folder that round-trips through transformers, and a tokenizer that encodes and
decodes the task strings exactly."""

import pytest
import torch

from rlhf.config import DataConfig, TinyModelConfig
from rlhf.stages.tasks import make_preference_rows, make_rows
from rlhf.weights.tiny import build_model, train_tokenizer


def test_save_load_gives_identical_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    again = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tok("sort 17 203 5 88 =", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = model(ids).logits, again(ids).logits
    assert a.shape == (1, ids.shape[1], len(tok))
    assert torch.equal(a, b)
    assert model.config.eos_token_id == tok.eos_token_id and model.config.model_type == "qwen2"


def test_rebuilding_with_the_same_seed_is_deterministic():
    tok = train_tokenizer()
    a = build_model(TinyModelConfig(), len(tok), tok.eos_token_id, tok.pad_token_id, seed=3)
    b = build_model(TinyModelConfig(), len(tok), tok.eos_token_id, tok.pad_token_id, seed=3)
    c = build_model(TinyModelConfig(), len(tok), tok.eos_token_id, tok.pad_token_id, seed=4)
    pa, pb, pc = (next(m.parameters()) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


@pytest.mark.parametrize("task", ["sort", "add"])
def test_tokenizer_round_trips_task_strings(tiny_model_dir, task):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    d = DataConfig(task=task, num_train=50)
    for row in make_rows(d, "train", seed=0) + make_preference_rows(d, "train", seed=0):
        for text in (row["prompt"], row.get("answer") or row["rejected"], row["prompt"] + (row.get("answer") or "")):
            ids = tok(text, add_special_tokens=False).input_ids
            assert tok.decode(ids) == text
            assert tok.unk_token_id not in ids


def test_digits_are_single_tokens(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pieces = tok.convert_ids_to_tokens(tok(" 5 17 88 203", add_special_tokens=False).input_ids)
    assert pieces == ["Ġ", "5", "Ġ", "1", "7", "Ġ", "8", "8", "Ġ", "2", "0", "3"]


def test_chat_template_renders(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "sort 3 1 ="}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nsort 3 1 =<|im_end|>\n<|im_start|>assistant\n"


def test_llama_architecture_builds():
    tok = train_tokenizer()
    model = build_model(TinyModelConfig(arch="llama"), len(tok), tok.eos_token_id, tok.pad_token_id)
    assert model.config.model_type == "llama"
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, len(tok))
