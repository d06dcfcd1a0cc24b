"""algorithms: the RLHF math as pure functions on tensors (no ray, vllm or deepspeed imports).

Shapes in docstrings: B batch, T tokens, V vocabulary, G group size.
"""
