"""A word-problem agent as users write them: the official `openai` client, a calculator declared as an OpenAI tool,
its calls run and their results sent back, the final answer scored by the math verifier. Nothing in it knows it is
being trained: `python -m rlhf.run --config examples/smollm2_math_agent.yaml` hands it a client pointed at the
rollout's endpoint; pointed at any OpenAI-compatible server it runs the same.

    import openai, examples.agents.calculator as agent
    agent.run({"prompt": [{"role": "user", "content": "Ann has 7 apples ..."}], "answer": "16"},
              openai.OpenAI(base_url="http://localhost:8000/v1", api_key="-"))
"""
from __future__ import annotations

import ast
import json
import operator

TOOLS = [{"type": "function", "function": {
    "name": "calculate", "description": "Evaluate an arithmetic expression, e.g. 17 - 8 or (3 + 4) * 2.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
MAX_TOOL_ROUNDS = 2
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """+ - * / on numbers, nothing else (never eval)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / are allowed")
    try:
        result = value(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def _result(call) -> str:
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    if call.function.name != "calculate" or not isinstance(args, dict):
        return f"error: no tool {call.function.name!r} taking those arguments; use calculate(expression)"
    return calculate(args.get("expression", ""))


def run(row: dict, client) -> float:
    from rollout.rewards import math_reward
    messages = list(row["prompt"]) if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_TOOL_ROUNDS + 1):
        message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        messages += [{"role": "tool", "tool_call_id": c.id, "content": _result(c)} for c in message.tool_calls]
    return math_reward([row["prompt"]], [message.content or ""], [row["answer"]])[0]
