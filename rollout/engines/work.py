"""What one of the engine's generate calls computed and read, for its span in the run's timeline (common.spans):
tokens prefilled (less prefix-cache hits) and generated, the seconds spent prefilling and decoding (from the
timestamps vLLM keeps per request: prefill from a request's scheduling to its first token, decode after), the
prefill's FLOPs and the bytes the decode steps read (common.flops). The driver turns them into perf/prefill_mfu
and perf/decode_bw_util (rlhf.outputs.worker_spans)."""
from __future__ import annotations

from typing import Optional

from common.flops import ModelShape, decode_bytes, forward_parts
from common.timeline import union_seconds


def generate_work(outputs: list, shape: Optional[ModelShape], devices: int, computed: int) -> dict:
    """A generate call's work from vLLM's RequestOutputs (`devices`: the engine's tensor-parallel workers;
    `computed`: the prompt tokens its counters say it computed meanwhile: with n samples a prompt, each sample is a
    request of its own, and an output's `num_cached_tokens` is one of theirs)."""
    prompts = [len(o.prompt_token_ids) for o in outputs]
    contexts = [(len(o.prompt_token_ids), len(c.token_ids)) for o in outputs for c in o.outputs]
    work = {"prefill_tokens": computed, "generated": sum(c for _, c in contexts), "sequences": len(contexts),
            "devices": devices}
    stats = [o.metrics for o in outputs if getattr(o.metrics, "first_token_ts", 0.0) > 0]
    if shape is None or not stats:
        return work
    prefill = union_seconds([(m.scheduled_ts, m.first_token_ts) for m in stats])
    busy = union_seconds([(m.scheduled_ts, max(m.last_token_ts, m.first_token_ts)) for m in stats])
    steps = max((c for _, c in contexts), default=1) - 1  # (at least: all sequences stepped together)
    # the matmuls for the tokens the counters saw; attention over each prompt whole, as many times over as they say
    # the prompts were computed (n samples scheduled together miss each other's cache; a cached prefix is not)
    _, attention = forward_parts(shape, prompts)
    attention *= computed / max(sum(prompts), 1)
    matmul = 2 * shape.matmul_params * computed + 2 * shape.head_params * len(contexts)  # (logits: a sample's last)
    return {**work, "prefill_s": prefill, "decode_s": max(busy - prefill, 0.0), "prefill_flops": matmul + attention,
            "decode_bytes": decode_bytes(shape, steps, contexts)}


def phase_spans(outputs: list, clock_offset: float) -> list[tuple[str, float, float]]:
    """('prefill', start, end) and ('decode', start, end) of a generate call, in host seconds since the epoch (vLLM's
    timestamps are the monotonic clock's: `clock_offset` = time.time() - time.monotonic()): prefill from the first
    request's scheduling to the last first token, decode from there to the last token. Approximate where a request
    is scheduled while others decode (its prefill then overlaps their decode); the seconds `generate_work` gives
    count each request's own intervals."""
    stats = [o.metrics for o in outputs if getattr(o.metrics, "first_token_ts", 0.0) > 0]
    if not stats:
        return []
    start = min(m.scheduled_ts for m in stats) + clock_offset
    first = max(m.first_token_ts for m in stats) + clock_offset
    last = max(max(m.last_token_ts, m.first_token_ts) for m in stats) + clock_offset
    return [("prefill", start, first), ("decode", first, last)]
