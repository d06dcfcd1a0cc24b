"""A GGUF file -> an ordinary Hugging Face folder (fp32 safetensors, the tokenizer with its chat template and the
GGUF's BOS rule, generation_config with the eos id), checked: the saved folder, loaded back, gives the GGUF model's
logits."""
from __future__ import annotations

import os

from common.errors import UserError

CHAT_PROBE = [{"role": "user", "content": "What is 12 + 7? Put the final answer in \\boxed{}."}]
TEXT_PROBE = "Question: What is 12 + 7?\nAnswer:"  # a base model without a chat template


def gguf_field(path: str, key: str):
    """One metadata value of a GGUF file (None when absent): a bool/int/float, or a str."""
    import gguf
    field = gguf.GGUFReader(path).fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


def load_gguf(path: str):
    """The tokenizer and the dequantized model as transformers reads them (the `gguf` package does the reading).
    transformers' GGUF tokenizer ignores `tokenizer.ggml.add_bos_token`; Gemma needs its BOS (without it a base
    Gemma-3 answers "The capital of France is" with "France. The The The"), so the rule is set from the file."""
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        raise UserError("reading GGUF files needs the `gguf` package: pip install -e '.[real]' "
                        "(make does this)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if gguf_field(path, "tokenizer.ggml.add_bos_token") and tokenizer.bos_token_id is not None:
        tokenizer.add_bos_token = True
        if tokenizer("x")["input_ids"][0] != tokenizer.bos_token_id:
            raise RuntimeError(f"{name}: its tokenizer must add {tokenizer.bos_token} and transformers' does not")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model


def plain_copy(gguf_model):
    """The same weights in a model transformers can save: a GGUF-loaded model refuses `save_pretrained` (it counts
    as quantized), so its state dict goes into a fresh model of its config without the quantization entry."""
    import torch
    from transformers import AutoModelForCausalLM
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    return model.eval()


def probe_ids(tokenizer):
    """A chat prompt through the chat template, or a plain question for a base model that has none."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(CHAT_PROBE, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    return tokenizer(TEXT_PROBE, return_tensors="pt")["input_ids"]


def probe_logits(model, tokenizer):
    import torch
    with torch.no_grad():
        return model(input_ids=probe_ids(tokenizer)).logits


def convert(gguf: str, out: str) -> dict:
    """Write the HF folder and check it. Returns the report the folder keeps (logit difference, parameters)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    tokenizer, gguf_model = load_gguf(gguf)
    expected = probe_logits(gguf_model, tokenizer)
    model = plain_copy(gguf_model)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    if AutoTokenizer.from_pretrained(out)("x")["input_ids"] != tokenizer("x")["input_ids"]:
        raise RuntimeError("GGUF conversion: the saved tokenizer encodes differently (its BOS rule was not kept)")
    diff = float((probe_logits(saved, tokenizer) - expected).abs().max())
    if diff > 1e-4:
        raise RuntimeError(f"GGUF conversion: the saved model's logits differ from the GGUF model's by {diff}")
    return {"max_logit_diff": diff, "parameters": sum(p.numel() for p in saved.parameters()),
            "adds_bos": bool(getattr(tokenizer, "add_bos_token", False))}
