"""A checkpoint this project did not create, for the tests and benchmarks/foreign_checkpoint.py: Llama-style, its
tokenizer adds `<s>` to every encoded text (a post-processor, as Llama's does), has no pad token, and its
`generation_config` lists two eos ids; `chat=True` gives it a Llama-3-like chat template that writes `<s>` itself
and closes turns with `<|eot_id|>`. `train_elsewhere` fine-tunes it with a plain PyTorch loop that tokenizes as
users' trainers do (`tokenizer(prompt)`, so with `<s>`)."""
from __future__ import annotations

SPECIALS = ["<s>", "</s>", "<unk>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama-3's shape: the template writes <s> itself, so rendering must add no second one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def foreign_tokenizer(chat: bool = False):
    """Byte-level BPE (digits one by one) whose post-processor prepends <s>, like Llama's; no pad token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = ["sort add = + the answer is user assistant"] * 8 + [" ".join(str(i) for i in range(1000))]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build_foreign_model(out_dir: str, chat: bool = False, hidden: int = 128, layers: int = 2, seed: int = 0) -> str:
    """A random-init Llama with the foreign tokenizer, saved as a Hugging Face folder. Its generation_config ends
    at </s> and at <|eot_id|> (several eos ids, as Llama-3 and Qwen2.5-Instruct checkpoints have)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = foreign_tokenizer(chat)
    eos, eot = tok.convert_tokens_to_ids(["</s>", "<|eot_id|>"])
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                         eos_token_id=eos, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [eos, eot]
    model.generation_config.bos_token_id = tok.bos_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def train_elsewhere(model_dir: str, steps: int, batch: int = 32, lr: float = 1e-3, seed: int = 0) -> None:
    """Supervised fine-tuning on the sort task by a plain PyTorch loop, tokenized the usual way: the prompt with the
    tokenizer's special tokens (<s>), the answer without, then </s>; loss on the answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.config import DataConfig
    from rlhf.stages.tasks import make_rows

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = make_rows(DataConfig(task="sort", num_train=steps * batch, min_items=3, max_items=4, max_value=49),
                     "train", seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        seqs, labels = [], []
        for r in rows[step * batch:(step + 1) * batch]:
            p = tok(r["prompt"]).input_ids
            a = tok(r["answer"], add_special_tokens=False).input_ids + [tok.eos_token_id]
            seqs.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.eos_token_id] * (width - len(s)) for s in seqs])
        lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        loss = model(input_ids=ids, attention_mask=attn, labels=lab).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 100 == 0:
            print(f"elsewhere sft step {step}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(model_dir, safe_serialization=True)
