"""How much a transformer computes and reads, from its config and its parameters' names and sizes: what the
utilisation metrics (rlhf.outputs.worker_spans) divide by the device's peaks.

A token's forward multiplies by every matmul weight once (2 FLOPs a weight: the input embedding is a lookup, a
tied head a matmul; a mixture of experts only its routed share of the experts), and attends to its context (QK^T and
AV: 4 FLOPs per context position, layer and query width, causal: a sequence of s tokens attends to 1 + ... + s).
A backward is twice its forward; recomputation (gradient checkpointing) is not counted, so the train utilisation
is model FLOPs utilisation (MFU), as PaLM's appendix B defines it and verl reports it. A decode step reads every
weight once for all the sequences it advances, and each sequence's cached keys and values."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

EXPERT = re.compile(r"(^|\.)experts\.")
EMBEDDING = re.compile(r"embed_tokens|wte\.|word_embeddings")


@dataclass(frozen=True)
class ModelShape:
    matmul_params: float  # weights a token is multiplied by
    layers: int
    query_width: int  # attention heads x head dim
    kv_bytes_per_token: float  # keys and values over every layer, in the cache's dtype
    weight_bytes: float  # every weight, as held


def _text_config(config) -> dict:
    config = config if isinstance(config, dict) else config.to_dict()
    return config.get("text_config") or config


def model_shape(config, numels: Iterable[tuple[str, int]], weight_bytes: float,
                cache_bytes: int) -> Optional[ModelShape]:
    """`config`: a Hugging Face config (or its dict); `numels`: (parameter name, element count) of the model as its
    owner holds it (named_parameters: a tied head once); `cache_bytes`: bytes per cached key or value element.
    None for a config without the usual names of its layers, width and heads."""
    c = _text_config(config)
    layers, hidden = _first(c, "num_hidden_layers", "n_layer"), _first(c, "hidden_size", "n_embd", "d_model")
    heads = _first(c, "num_attention_heads", "n_head")
    if not (layers and hidden and heads):
        return None
    head_dim = int(c.get("head_dim") or hidden // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts")
    routed = (c.get("num_experts_per_tok") or 0) / experts if experts else 1.0
    tied = bool(c.get("tie_word_embeddings", False))
    total = 0.0
    for name, n in numels:
        if EMBEDDING.search(name) and not tied:
            continue  # a lookup (a tied one is the head's matmul too: counted once, as the head)
        total += n * (routed if EXPERT.search(name) else 1.0)
    return ModelShape(total, layers, heads * head_dim, 2.0 * layers * kv_heads * head_dim * cache_bytes, weight_bytes)


def _first(config: dict, *keys: str) -> int:
    return next((int(config[k]) for k in keys if isinstance(config.get(k), int)), 0)


def forward_flops(shape: Optional[ModelShape], lengths: Sequence[int], cached: Sequence[int] = ()) -> float:
    """A forward over sequences of `lengths` tokens, of which the first `cached` (a prefix cache's hits) are not
    computed again (they are still attended to)."""
    total = 0.0
    for i, s in enumerate(lengths if shape is not None else ()):
        c = min(cached[i] if i < len(cached) else 0, s)
        attended = (s * (s + 1) - c * (c + 1)) / 2  # positions attended to, summed over the computed tokens
        total += 2 * shape.matmul_params * (s - c) + 4 * shape.layers * shape.query_width * attended
    return total


def decode_bytes(shape: ModelShape, steps: int, contexts: Sequence[tuple[int, int]]) -> float:
    """Bytes `steps` decode steps read: the weights once a step, and for each (prompt, completion) the cache of
    every token before each new one (the first is the prefill's)."""
    cache_reads = sum(max(c - 1, 0) * p + c * (c - 1) / 2 for p, c in contexts)
    return steps * shape.weight_bytes + cache_reads * shape.kv_bytes_per_token
