"""Chat templates for checkpoints that ship none (base models: Gemma-3-270M), chosen with `data.chat_template`: a
built-in name or a Jinja file, as TRL's `chat_template_path` and OpenRLHF's `--tokenizer_chat_template` take one.
The run saves the tokenizer with its template into every model folder it writes, so a later stage started from
that folder (SFT, then GRPO) renders the same way without naming it again.

Built-ins, each with its model family's own special tokens (a template whose markers the vocabulary lacks would
split them into ordinary pieces and have no single turn-closing token to stop on):
- `gemma`: Gemma's turns, `<start_of_turn>user ... <end_of_turn>`, the assistant's role written `model`; a system
  message goes before the first user message's text, as Gemma's instruction-tuned models take it.
- `chatml`: `<|im_start|>role ... <|im_end|>` (Qwen, SmolLM2).
"""
from __future__ import annotations

import os

from common.errors import UserError

GEMMA = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] + '\\n\\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ system if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILT_IN = {"gemma": GEMMA, "chatml": CHATML}
MARKERS = {"gemma": ("<start_of_turn>", "<end_of_turn>"), "chatml": ("<|im_start|>", "<|im_end|>")}


def resolve(value: str, tokenizer) -> str:
    """The Jinja text `data.chat_template` names: a built-in (its markers checked to be single tokens of this
    tokenizer) or a file."""
    if value in BUILT_IN:
        missing = [m for m in MARKERS[value] if m not in tokenizer.get_vocab()]
        if missing:
            raise UserError(f"data.chat_template: {value!r} writes {' and '.join(missing)}, which this tokenizer has "
                            f"no token for; choose a template of the model's family ({', '.join(BUILT_IN)}) or give a "
                            f"Jinja file")
        return BUILT_IN[value]
    if not os.path.isfile(value):
        raise UserError(f"data.chat_template: {value!r} is neither a built-in ({', '.join(BUILT_IN)}) nor a file; "
                        f"give one of those or the path of a Jinja chat template")
    with open(value, encoding="utf-8") as f:
        text = f.read()
    if "messages" not in text:
        raise UserError(f"data.chat_template: {value} does not read `messages`, so it is not a chat template")
    return text
