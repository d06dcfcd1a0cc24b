"""An agent's chat requests as the engine sees them, and the engine's text back as an OpenAI message.

- `chat_ids`: a request's messages (and `tools`) through the checkpoint's chat template with its generation prompt.
  A template that cannot write tools (SmolLM2's has no `tools` variable) gets them as a system message in the
  Hermes format (`<tools>` JSON, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`), the format Qwen2.5's own
  template writes and vLLM's `hermes` parser reads: the closest honest format for a model never taught tools.
- `continuation_ids`: the ids that follow a model turn when a request extends the conversation the engine already
  holds (its earlier messages unchanged, the model's reply as returned, then new messages): what the template writes
  after the reply, then the new messages and the generation prompt. The model's own ids are never re-rendered.
- `same_message`: whether a message the agent sent back is the one it was given (content and tool calls; ids and
  the client's extra keys aside).
- `ToolCalls`: vLLM's tool-call parser for the model family (`agent.tool_parser`) over the model's text.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

from rollout.render import RenderError

HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>"
)


def _text(content) -> str:
    """OpenAI content: a string, None, or a list of parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RenderError("message content must be a string or a list of text parts; images and audio are not "
                      "served by this endpoint")


def _arguments(value):
    """A tool call's arguments as the templates write them: a JSON object, parsed from the client's string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise RenderError(f"tool call arguments {value[:80]!r} are not JSON") from None
    return value


def hermes_call(function: dict) -> str:
    """One tool call as the Hermes format writes it (Qwen2.5's template, byte for byte)."""
    call = {"name": function["name"], "arguments": function["arguments"]}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"


def for_template(messages: Sequence[dict], tools: Optional[list], native_tools: bool) -> list[dict]:
    """`messages` as chat templates take them: text content, tool-call arguments as objects; with `tools` and a
    template that cannot write them (`native_tools` false), their description as (the start of) the system message."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": _text(m.get("content"))}
        calls = [{"type": "function", "id": c.get("id"), "function": {
            "name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments", "{}"))}}
            for c in m.get("tool_calls") or ()]
        if calls and native_tools:
            msg["tool_calls"] = calls
        elif calls:  # a template that cannot write tool calls gets them as the model was told to write them
            msg["content"] += ("\n" if msg["content"] else "") + "\n".join(hermes_call(c["function"]) for c in calls)
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        out.append(msg)
    if tools and not native_tools:
        described = HERMES_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def render(tokenizer, messages: list[dict], tools: Optional[list], generation_prompt: bool) -> str:
    native = "tools" in (tokenizer.chat_template or "")
    try:
        return tokenizer.apply_chat_template(for_template(messages, tools, native), tools=tools if native else None,
                                             add_generation_prompt=generation_prompt, tokenize=False)
    except RenderError:
        raise
    except Exception as e:  # a template's own raise_exception (e.g. roles out of order) or a Jinja error
        raise RenderError(f"the chat template cannot render these messages: {e}") from None


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids  # the template wrote its own special tokens


def chat_ids(tokenizer, messages: list[dict], tools: Optional[list]) -> list[int]:
    if not tokenizer.chat_template:
        raise RenderError("this checkpoint's tokenizer has no chat template: set data.chat_template, or call "
                          "/v1/completions with a prompt")
    return _ids(tokenizer, render(tokenizer, messages, tools, True))


def continuation_ids(tokenizer, close_id: Optional[int], history: list[dict], reply: dict, new: list[dict],
                     tools: Optional[list], closed: bool) -> Optional[list[int]]:
    """Ids that follow the engine's ids of `history` + the model's `reply` (which ended on the turn-closing token
    when `closed`) and open its next turn after the `new` messages; None when the template cannot write them as a
    continuation (it rewrites earlier turns) or has no turn-closing token to align on."""
    through = render(tokenizer, [*history, reply], tools, False)
    after = render(tokenizer, [*history, reply, *new], tools, True)
    close = tokenizer.convert_ids_to_tokens(close_id) if close_id is not None else None
    at = through.rfind(close) if close else -1
    if not after.startswith(through) or at < 0:
        return None
    tail = through[at + len(close):] if closed else through[at:]  # what the template writes after the reply
    return _ids(tokenizer, tail + after[len(through):])


def _key(message: dict) -> tuple:
    calls = tuple((c["function"]["name"], json.dumps(_arguments(c["function"].get("arguments", "{}")),
                                                     sort_keys=True)) for c in message.get("tool_calls") or ())
    return message.get("role"), _text(message.get("content")), calls


def same_message(a: dict, b: dict) -> bool:
    try:
        return _key(a) == _key(b)
    except (RenderError, KeyError, TypeError):
        return False


class ToolCalls:
    """vLLM's tool-call parser `name` (agent.tool_parser: hermes, llama3_json, pythonic, ...) for `tokenizer`."""

    def __init__(self, name: str, tokenizer):
        import logging

        from vllm.tool_parsers import ToolParserManager
        self.cls, self.tokenizer = ToolParserManager.get_tool_parser(name), tokenizer
        # A call the model wrote badly comes back as plain text (vLLM's behaviour); the parser's traceback for each
        # one would bury the run's console while a policy is still learning the format.
        logging.getLogger(self.cls.__module__).setLevel(logging.CRITICAL)

    def message(self, text: str, request) -> tuple[dict, bool]:
        """The assistant message for the model's `text` (special tokens dropped) and whether it calls tools; a
        request without tools, or with tool_choice none, gets the text as it is."""
        if not request.tools or request.tool_choice == "none":
            return {"role": "assistant", "content": text}, False
        found = self.cls(self.tokenizer, request.tools).extract_tool_calls(text, request)
        if not found.tools_called:
            return {"role": "assistant", "content": text}, False
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                               "arguments": c.function.arguments}}
                 for c in found.tool_calls]
        return {"role": "assistant", "content": found.content or None, "tool_calls": calls}, True
