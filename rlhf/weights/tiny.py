"""The tiny-model kit: a tokenizer trained locally with `tokenizers` and a randomly initialised Qwen2/Llama causal LM,
saved together as an ordinary Hugging Face folder that transformers and vLLM both load (nothing is downloaded)."""
from __future__ import annotations

import os
import shutil

from rlhf.config import TinyModelConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS, PAD = "<|endoftext|>", "<|pad|>"
# A ChatML template, so `apply_chat_template` works the same as on Qwen checkpoints.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    """Text covering the task vocabulary: words, digits, separators and punctuation."""
    words = ["sort", "add", "=", "+", "-", "*", "user", "assistant", "system", "the", "answer", "is"]
    return [" ".join(words)] * 8 + [" ".join(str(i) for i in range(1000))] + [
        "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,:;!?()[]{}'\"\n"]


def train_tokenizer(vocab_size: int = 320):
    """A byte-level BPE that splits digits one by one (numbers stay learnable) and decodes text exactly.

    Returns a `transformers.PreTrainedTokenizerFast` with EOS/PAD set and a ChatML template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None,
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(cfg: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int, seed: int = 0):
    """A random-init causal LM of the configured architecture (fp32)."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}[cfg.arch]
    experts = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.intermediate_size, head_dim=cfg.hidden_size // cfg.num_heads,
                   norm_topk_prob=True) if cfg.arch == "qwen3_moe" else {}
    config = config_cls(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=eos_id, torch_dtype="float32", **experts,
    )
    torch.manual_seed(seed)
    return model_cls(config)


def save_tiny_model(cfg: TinyModelConfig, out_dir: str, seed: int = 0) -> str:
    """Build tokenizer + model and save them as a Hugging Face folder (safetensors). Returns `out_dir`."""
    tokenizer = train_tokenizer()
    model = build_model(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # Write to a temp folder and rename, so an interrupted build never leaves a half-written model behind.
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def ensure_model(path: str | None, tiny: TinyModelConfig, output_dir: str, seed: int) -> str:
    """The model folder to use: `path` when the user gave one, else the tiny model (built once per run dir)."""
    if path is not None:
        if not os.path.isfile(os.path.join(path, "config.json")):
            from common.errors import UserError
            from rlhf.weights.catalog import MODELS
            real = [k for k, m in MODELS.items() if m.folder == os.path.basename(os.path.normpath(path))]
            if real:
                raise UserError(f"model.path = {path!r}: the real model is not converted yet; run `python -m "
                                f"rlhf.models {real[0]}` once, then rerun")
            raise UserError(f"model.path = {path!r}: no config.json there; point it at a local Hugging Face model "
                            "folder (e.g. the `final` folder an earlier stage wrote), or unset it to build the tiny "
                            "model")
        check_model_folder(path, "model.path")
        return path
    out = os.path.join(output_dir, "init_model")
    if not os.path.isfile(os.path.join(out, "config.json")):
        os.makedirs(output_dir, exist_ok=True)
        save_tiny_model(tiny, out, seed)
    return out


def check_model_folder(path: str, key: str) -> None:
    """Before anything starts: `path`'s config.json parses, its weights are there and each safetensors file is
    whole (its header covers the file: a copy cut short fails here), and it has a tokenizer. UserError naming `key`,
    the file and the fix; otherwise transformers or a Ray worker would fail later with a traceback."""
    import glob
    import json

    from common.errors import UserError

    def bad(what: str) -> UserError:
        return UserError(f"{key} = {path!r}: {what}; point it at a whole Hugging Face model folder (config.json, "
                         "weights, tokenizer), e.g. one save_pretrained wrote")
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise bad(f"config.json is not readable JSON ({e})") from None
    if not isinstance(config, dict) or not (config.get("model_type") or config.get("architectures")):
        raise bad("config.json names no model_type or architectures")
    shards = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not shards and not glob.glob(os.path.join(path, "pytorch_model*.bin")):
        raise bad("it holds no weights (*.safetensors or pytorch_model*.bin)")
    from safetensors import safe_open
    for shard in shards:
        try:
            with safe_open(shard, framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise bad(f"{os.path.basename(shard)} cannot be read ({e}): a copy cut short?") from None
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, n)) for n in names):
        raise bad(f"it has no tokenizer (none of {', '.join(names)})")
