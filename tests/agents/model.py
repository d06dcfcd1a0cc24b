"""A tiny model taught one tool-using conversation (the calculator agent's), so the real engine, sampling greedily,
makes a real tool call through the endpoint: 120 full-batch steps on one sequence, about 5 s on one core."""
from __future__ import annotations

from tests.agents.toy import TOOLS

CALL = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
CONVERSATION = [{"role": "user", "content": "what is 2 + 3?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_0", "content": "5"},
                {"role": "assistant", "content": "5"}]


def teach_tool_call(folder: str, steps: int = 120) -> str:
    """Builds the tiny kit's model in `folder` (1024 positions: the tools' system prompt is long) and trains it on
    CONVERSATION's two assistant turns, rendered as the endpoint renders them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.config import TinyModelConfig
    from rlhf.weights.tiny import save_tiny_model
    from rollout.agents.render import chat_ids, render

    torch.manual_seed(0)
    save_tiny_model(TinyModelConfig(max_position_embeddings=1024), folder)
    tok = AutoTokenizer.from_pretrained(folder)
    whole = tok(render(tok, CONVERSATION, TOOLS, False), add_special_tokens=False).input_ids
    close = tok.convert_tokens_to_ids("<|im_end|>")
    mask = torch.zeros(len(whole), dtype=torch.bool)
    for turn in (1, 3):  # each assistant turn: after its generation prompt, through its <|im_end|>
        start = len(chat_ids(tok, CONVERSATION[:turn], TOOLS))
        mask[start:whole.index(close, start) + 1] = True
    model = AutoModelForCausalLM.from_pretrained(folder)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.tensor([whole])
    for _ in range(steps):
        logits = model(x).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[1:]], x[0, 1:][mask[1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(folder)
    return folder
