"""The rollout's OpenAI-compatible endpoint without a training run: one vLLM engine behind
`http://HOST:PORT/demo/v1`, for trying an agent (or curl) against exactly what a run serves it, with the same chat
template, tool parser, sampling and token capture.

    python -m rlhf.agent_serve --model ~/.cache/rlhf-orchestra/models/SmolLM2-135M-Instruct --port 8000
    curl -s http://127.0.0.1:8000/demo/v1/chat/completions -H 'Content-Type: application/json' \\
         -H "Authorization: Bearer $KEY" \\
         -d '{"model": "policy", "messages": [{"role": "user", "content": "What is 7 + 9?"}]}'

`$KEY` is the bearer token it prints (or gives: `--api-key`, `$RLHF_AGENT_API_KEY`). Ctrl-C stops it and prints what
was captured: the calls, the samples they were stitched into, the history breaks.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Optional


def engine_dtype(requested: str) -> str:
    """--dtype as the engine loads it: auto by the machine (its GPU, else this CPU's probe on all its cores), an
    explicit value as given, with the same warning a run gives where bf16 would be slow."""
    import torch

    from common.fast_dtype import choose_dtype, run_device
    choice = choose_dtype(requested, run_device(torch.cuda.device_count(), os.cpu_count() or 1), key="--dtype")
    if choice.warning:
        print(f"warning: {choice.warning}", file=sys.stderr)
    return choice.dtype


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlhf.agent_serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("RLHF_AGENT_API_KEY"),
                   help="the bearer token every request must carry (default: $RLHF_AGENT_API_KEY, else a new one, "
                        "printed)")
    p.add_argument("--tool-parser", default="hermes", help="vLLM's tool-call parser for the model family")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="auto: bfloat16 where this machine runs it fast, else float32 (docs/precision.md)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.6)
    args = p.parse_args(argv)

    from common.errors import UserError
    from common.remote import init_ray
    from common.schema import AgentConfig
    from rollout.agents.runner import AgentRunner
    from rollout.engine import SamplingConfig
    from rollout.engines.vllm import VLLMEngine
    from rollout.group import RolloutGroup
    from rollout.render import PromptRenderer

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"error: --model {args.model}: not a Hugging Face folder (no config.json)", file=sys.stderr)
        return 2
    try:
        renderer = PromptRenderer.from_pretrained(args.model)
        cfg = AgentConfig(tool_parser=args.tool_parser, max_calls=2 ** 31, host=args.host, port=args.port)
        dtype = engine_dtype(args.dtype)
        init_ray()
        group = RolloutGroup.create(1, dict(model_path=args.model, dtype=dtype, max_model_len=args.max_model_len,
                                            kv_cache_mb=1024), engine_cls=VLLMEngine)
        runner = AgentRunner(group, renderer, cfg, args.max_model_len, token=args.api_key)
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"serving {args.model} ({dtype}) at {runner.endpoint.url('demo')}, api key {runner.endpoint.token} "
          "(header Authorization: Bearer <key>); Ctrl-C stops", flush=True)
    try:
        episode = runner.serve("demo", SamplingConfig(max_new_tokens=args.max_new_tokens,
                                                      temperature=args.temperature), stop)
    finally:
        runner.close()
        group.shutdown()
    sampled = sum(sum(t.mask) for t in episode.samples)
    print(f"captured {episode.calls} calls as {len(episode.samples)} samples ({episode.breaks} history breaks), "
          f"{sampled} sampled tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
