"""The one prompt renderer: dataset prompts and answers to token ids, the same way for every stage (sft, rm, dpo,
rl), for evaluation and for the engines, so the ids the trainer sees are the ids vLLM generated from.

- A string prompt is tokenized with the tokenizer's own special tokens (`<bos>` once where the tokenizer adds it).
- A conversational prompt (a list of `{"role", "content"}` messages, as TRL, verl and OpenRLHF datasets hold them)
  is rendered with the checkpoint's chat template and its generation prompt; so is a string prompt when
  `chat=True` (`data.apply_chat_template`), as one user message.
- Generation stops at the tokenizer's eos, at every eos id of the checkpoint's `generation_config`, and, for
  chat-rendered prompts, at the token that closes an assistant turn (`<|im_end|>`, `<|eot_id|>`).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence, Union

from common.errors import UserError

Messages = list[dict]
Prompt = Union[str, Messages]
_MARK = "Z9q"  # an answer text no template writes itself: where it lands, the template's own text begins
_PROBE = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]


class RenderError(UserError):
    """A prompt or answer the tokenizer cannot render as asked; the message says how to fix it."""


def is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                           and isinstance(m.get("content"), str) for m in value) and bool(value)


class PromptRenderer:
    def __init__(self, tokenizer, chat: bool = False, generation_eos: Sequence[int] = ()):
        self.tokenizer, self.chat = tokenizer, chat
        if chat and not tokenizer.chat_template:
            raise RenderError("data.apply_chat_template is true but the tokenizer has no chat_template; set it "
                              "to false for a base model, give it one with data.chat_template (gemma, chatml or a "
                              "Jinja file), or use a checkpoint whose tokenizer_config.json has one")
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None)
        self._close_id = self._turn_close_id() if tokenizer.chat_template else None
        self._stops = [i for i in [self.eos_id, *generation_eos] if i is not None]

    @classmethod
    def from_pretrained(cls, path: str, chat: bool = False, trust_remote_code: bool = False,
                        chat_template: Optional[str] = None) -> "PromptRenderer":
        """The tokenizer of the checkpoint at `path`, and its generation_config's eos ids when it has one;
        `chat_template` (data.chat_template: a built-in name or a Jinja file, rollout.render.chat_templates) replaces
        the tokenizer's own."""
        from transformers import AutoTokenizer, GenerationConfig

        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if chat_template:
            from rollout.render.chat_templates import resolve
            tok.chat_template = resolve(chat_template, tok)
        eos: list[int] = []
        if os.path.isfile(os.path.join(path, "generation_config.json")):
            found = GenerationConfig.from_pretrained(path).eos_token_id
            eos = list(found) if isinstance(found, (list, tuple)) else [] if found is None else [found]
        return cls(tok, chat, eos)

    @property
    def close_id(self) -> Optional[int]:
        """The token that closes an assistant turn in the chat template (`<|im_end|>`), None without one."""
        return self._close_id

    # ---- prompts ----
    def uses_template(self, prompt: Prompt) -> bool:
        return not isinstance(prompt, str) or self.chat

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids the model continues from: the generation prompt of a conversation, or the tokenized string."""
        if self.uses_template(prompt):
            return self._template_ids(self._as_messages(prompt), generation_prompt=True)
        ids = self.tokenizer(prompt).input_ids
        bos = self.tokenizer.bos_token_id
        if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:  # the text already began with <bos>
            ids = ids[1:]
        if self.eos_id is not None and len(ids) > 1 and ids[-1] == self.eos_id and not prompt.endswith(
                str(self.tokenizer.eos_token)):  # a tokenizer that appends eos (add_eos_token): a prompt goes on
            ids = ids[:-1]
        return ids

    def render_text(self, ids: Sequence[int]) -> str:
        """Ids as text with the special tokens and template kept: what the model really saw (rollout dumps)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """A completion's text for reward functions: special tokens (eos, turn ends) dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def stop_ids(self, prompts: Sequence[Prompt] = ()) -> tuple[int, ...]:
        """Where generation from `prompts` ends: the tokenizer's eos, the generation_config's eos ids, and the
        turn-closing token when any prompt is chat-rendered. Ordered, unique."""
        stops = list(self._stops)
        if self._close_id is not None and any(self.uses_template(p) for p in prompts):
            stops.append(self._close_id)
        return tuple(dict.fromkeys(stops))

    # ---- supervised targets ----
    def answer_ids(self, prompt: Prompt, answer: Union[str, Messages]) -> list[int]:
        """Ids of an answer that follows `prompt_ids(prompt)`, ending with the token that ends it: eos for plain
        text, the turn-closing token when the prompt is chat-rendered. `answer` is a string or assistant
        message(s)."""
        if not self.uses_template(prompt) and isinstance(answer, str):
            return self.tokenizer(answer, add_special_tokens=False).input_ids + [self.eos_id]
        messages = self._as_messages(prompt)
        # conversation_ids checks that the prompt's generation rendering (prompt_ids) is a prefix of this one, so
        # the masked tokens are exactly what the model generates after it.
        ids, mask = self.conversation_ids(messages + _assistant(answer), first_target=len(messages))
        return [t for t, m in zip(ids, mask) if m]

    def conversation_ids(self, messages: Messages, first_target: int = 0) -> tuple[list[int], list[bool]]:
        """A whole conversation's ids, and a mask that is true on the tokens of its assistant turns (from message
        `first_target` on): their content and the token that closes each turn, nothing the template adds after it.
        Each turn's span is the difference between the rendering up to it (with the generation prompt) and the
        rendering through it, so a template whose earlier turns change later cannot silently misalign."""
        ids = self._template_ids(messages, generation_prompt=False)
        mask = [False] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < first_target:
                continue
            before = self._template_ids(messages[:i], generation_prompt=True) if i else []
            through = self._template_ids(messages[:i + 1], generation_prompt=False)
            if ids[:len(through)] != through or through[:len(before)] != before:
                raise RenderError(f"message {i}: the chat template does not render this conversation as a prefix "
                                  "of its continuation (templates that rewrite earlier turns, e.g. drop reasoning, "
                                  "cannot be trained turn by turn); train on single-turn rows instead")
            span = list(range(len(before), len(through)))
            closes = [j for j in span if ids[j] == self._close_id]
            for j in span[:span.index(closes[-1]) + 1] if closes else span:
                mask[j] = True
        return ids, mask

    # ---- multi-turn ----
    def turn_ids(self, content: str, role: str = "user", closed: bool = True) -> list[int]:
        """Ids that follow a model turn of a multi-turn trajectory and open the model's next turn: what the chat
        template writes after an assistant message (less its closing token when `closed`: the model sampled that),
        `content` as a `role` message, then the generation prompt. The model's own ids are never re-rendered, so a
        trajectory holds exactly what the engine produced. Without a chat template: `content`'s tokens."""
        if not self.tokenizer.chat_template:
            return self.tokenizer(content, add_special_tokens=False).input_ids
        before = self.tokenizer.apply_chat_template(_PROBE, tokenize=False)
        after = self.tokenizer.apply_chat_template(_PROBE + [{"role": role, "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
        if not after.startswith(before) or _MARK not in before:
            raise RenderError(f"the chat template does not render a {role!r} message after an assistant turn as a "
                              "continuation; set env.observation_role to a role it renders (user)")
        text = before.rsplit(_MARK, 1)[1] + after[len(before):]
        close = self.tokenizer.convert_ids_to_tokens(self.close_id) if self.close_id is not None else None
        if closed and close and text.startswith(close):
            text = text[len(close):]
        return self.tokenizer(text, add_special_tokens=False).input_ids

    # ---- internals ----
    def _as_messages(self, prompt: Prompt) -> Messages:
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if not is_messages(prompt):
            raise RenderError("a conversational prompt must be a non-empty list of {'role': str, 'content': str}")
        return prompt

    def _template_ids(self, messages: Messages, generation_prompt: bool) -> list[int]:
        if not self.tokenizer.chat_template:
            raise RenderError("a conversational prompt needs a chat template, and this tokenizer has none; give "
                              "string prompts, set data.chat_template (gemma, chatml or a Jinja file), or use a "
                              "checkpoint whose tokenizer_config.json has a chat_template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        # The template writes the special tokens it wants (a <bos> included): add none of our own.
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _turn_close_id(self) -> Optional[int]:
        """The token a chat template closes an assistant turn with, found by rendering one: the first token after
        the answer's text, if that is a special (added) token."""
        try:
            before = self.tokenizer.apply_chat_template(_PROBE[:1], add_generation_prompt=True, tokenize=False)
            after = self.tokenizer.apply_chat_template(_PROBE, tokenize=False)
        except Exception:  # a template that cannot render a plain user/assistant exchange has no turn close
            return None
        tail = after[len(before):].split(_MARK, 1)
        if not after.startswith(before) or len(tail) != 2 or not tail[1]:
            return None
        first = self.tokenizer(tail[1], add_special_tokens=False).input_ids[:1]
        return first[0] if first and first[0] in self.tokenizer.added_tokens_decoder else None


def _assistant(answer: Union[str, Messages]) -> Messages:
    if isinstance(answer, str):
        return [{"role": "assistant", "content": answer}]
    if not is_messages(answer) or any(m["role"] != "assistant" for m in answer):
        raise RenderError("an answer given as messages must be a list of {'role': 'assistant', 'content': str}")
    return answer


def render_prompts(engine, prompts: Sequence, sampling) -> tuple[list[list[int]], tuple[int, ...]]:
    """An engine's prompts as token ids, and the stop ids to generate with. Token-id prompts pass through; text and
    message-list prompts are rendered by the renderer of the engine's checkpoint (built once, from
    `engine.model_path`), whose stop ids then join the sampling's."""
    texts = [p for p in prompts if isinstance(p, str) or is_messages(p)]
    if not texts:
        return [list(p) for p in prompts], tuple(sampling.stop_token_ids)
    if engine._renderer is None:
        if engine.model_path is None:
            raise ValueError("this engine wraps a bare model: pass token ids, not text or messages")
        engine._renderer = PromptRenderer.from_pretrained(engine.model_path,
                                                          trust_remote_code=engine.trust_remote_code)
    r = engine._renderer
    ids = [r.prompt_ids(p) if isinstance(p, str) or is_messages(p) else list(p) for p in prompts]
    return ids, tuple(dict.fromkeys([*sampling.stop_token_ids, *r.stop_ids(texts)]))
