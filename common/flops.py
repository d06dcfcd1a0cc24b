"""How much a transformer computes and reads, from its config and its parameters' names and sizes: what the
utilisation metrics (rlhf.outputs.worker_spans) divide by the device's peaks.

A token's forward multiplies by every matmul weight of the body once (2 FLOPs a weight: the input embedding is a
lookup; a mixture of experts only its routed share of the experts), by the output head only where logits are
computed (a prefill's last token, a trainer's trained positions), and attends to its context (QK^T and AV: 4 FLOPs
per context position, layer and query width, causal: a sequence of s tokens attends to 1 + ... + s). A backward is
twice its forward where every weight trains; with a frozen base (LoRA) its weights' gradients are not computed, only
the inputs', so the matmuls' backward is (1 + trainable share) times their forward. Recomputation (gradient
checkpointing) is not counted, so the train utilisation is model FLOPs utilisation (MFU), as PaLM's appendix B
defines it. A decode step reads every weight once for all the sequences it advances, and each sequence's cached
keys and values."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

EXPERT = re.compile(r"(^|\.)experts\.")
EMBEDDING = re.compile(r"embed_tokens|wte\.|word_embeddings")
HEAD = re.compile(r"(^|\.)(lm_head|embed_out|output_layer)\.")
NOT_TEXT = re.compile(r"vision|visual|image|audio|multi_modal_projector")  # (towers a text token never passes)


@dataclass(frozen=True)
class ModelShape:
    matmul_params: float  # the body's weights a token is multiplied by (routed share of experts)
    head_params: float  # the output head's, once per position whose logits are computed
    layers: int
    query_width: int  # attention heads x head dim
    kv_bytes_per_token: float  # keys and values over every layer, in the cache's dtype
    weight_bytes: float  # every weight, as held


def _dicts(config) -> tuple[dict, dict]:
    """(the text model's config, the outer one) as dicts; empty for none."""
    if config is None:
        return {}, {}
    outer = config if isinstance(config, dict) else config.to_dict()
    return outer.get("text_config") or outer, outer


def model_shape(config, numels: Iterable[tuple[str, int]], weight_bytes: float,
                cache_bytes: int) -> Optional[ModelShape]:
    """`config`: a Hugging Face config (or its dict); `numels`: (parameter name, element count) of the model as its
    owner holds it (named_parameters: a tied head once, under the embedding's name); `cache_bytes`: bytes per
    cached key or value element. None for a config without the usual names of its layers, width and heads."""
    c, outer = _dicts(config)
    layers, hidden = _first(c, "num_hidden_layers", "n_layer"), _first(c, "hidden_size", "n_embd", "d_model")
    heads = _first(c, "num_attention_heads", "n_head")
    if not (layers and hidden and heads):
        return None
    head_dim = int(c.get("head_dim") or hidden // heads)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts")
    routed = (c.get("num_experts_per_tok") or 0) / experts if experts else 1.0
    tied = bool(c.get("tie_word_embeddings", outer.get("tie_word_embeddings", False)))
    body = head = 0.0
    for name, n in numels:
        if NOT_TEXT.search(name):
            continue
        if HEAD.search(name) or (tied and EMBEDDING.search(name)):
            head += n
        elif not EMBEDDING.search(name):  # (an untied embedding is a lookup)
            body += n * (routed if EXPERT.search(name) else 1.0)
    return ModelShape(body, head, layers, heads * head_dim, 2.0 * layers * kv_heads * head_dim * cache_bytes,
                      weight_bytes)


def _first(config: dict, *keys: str) -> int:
    return next((int(config[k]) for k in keys if isinstance(config.get(k), int)), 0)


def forward_parts(shape: Optional[ModelShape], lengths: Sequence[int], cached: Sequence[int] = (),
                  logits: Optional[Sequence[int]] = None) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of a forward over sequences of `lengths` tokens, of which the first `cached`
    (a prefix cache's hits) are not computed again (they are still attended to), with logits at `logits`
    positions of each (None: every computed token)."""
    matmul = attention = 0.0
    for i, s in enumerate(lengths if shape is not None else ()):
        c = min(cached[i] if i < len(cached) else 0, s)
        heads = (s - c) if logits is None else logits[i]
        matmul += 2 * shape.matmul_params * (s - c) + 2 * shape.head_params * heads
        attention += 4 * shape.layers * shape.query_width * (s * (s + 1) - c * (c + 1)) / 2
    return matmul, attention


def forward_flops(shape: Optional[ModelShape], lengths: Sequence[int], cached: Sequence[int] = (),
                  logits: Optional[Sequence[int]] = None) -> float:
    """forward_parts' two, summed."""
    return sum(forward_parts(shape, lengths, cached, logits))


def backward_flops(matmul: float, attention: float, trainable: float = 1.0) -> float:
    """A backward's FLOPs from its forward's parts: attention's gradients are the inputs' (twice its forward);
    a matmul's are the input's (once) and, for the `trainable` share of weights, the weight's (once more)."""
    return 2 * attention + (1 + trainable) * matmul


def decode_bytes(shape: ModelShape, steps: int, contexts: Sequence[tuple[int, int]]) -> float:
    """Bytes `steps` decode steps read: the weights once a step, and for each (prompt, completion) the cache of
    every token before each new one (the first is the prefill's)."""
    cache_reads = sum(max(c - 1, 0) * p + c * (c - 1) / 2 for p, c in contexts)
    return steps * shape.weight_bytes + cache_reads * shape.kv_bytes_per_token
