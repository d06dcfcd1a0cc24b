"""Generation stops where the checkpoint stops: at every eos id of its generation_config (not only the tokenizer's
eos), with the stop token kept as the completion's last id and finish_reason "stop"; a cut-off completion keeps
"length". Both engines, on a Llama-style checkpoint this project did not build the usual way."""
import json
import os

import pytest

from rollout.engine import SamplingConfig
from rollout.render import PromptRenderer
from tests.fixtures.foreign import build_foreign_model

PROMPT = "sort 3 1 ="


def add_eos(model_dir: str, token: int) -> None:
    path = os.path.join(model_dir, "generation_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = list(cfg["eos_token_id"]) + [token]
    with open(path, "w") as f:
        json.dump(cfg, f)


def check_stops(generate, model_dir: str) -> None:
    """`generate(ids, sampling)` -> samples. A greedy run picks a token the model emits; once the generation_config
    names it an eos, the same run must end right after its first occurrence."""
    renderer = PromptRenderer.from_pretrained(model_dir)
    ids = renderer.prompt_ids(PROMPT)
    base = generate([ids], SamplingConfig(max_new_tokens=10, temperature=0.0, stop_token_ids=renderer.stop_ids()))[0]
    assert base.finish_reason == "length" and len(base.completion_ids) == 10  # random weights: no eos in 10 tokens
    j = base.completion_ids.index(base.completion_ids[-1])  # the first occurrence of the last token
    add_eos(model_dir, base.completion_ids[j])
    renderer = PromptRenderer.from_pretrained(model_dir)
    assert base.completion_ids[j] in renderer.stop_ids()
    out = generate([ids], SamplingConfig(max_new_tokens=10, temperature=0.0, stop_token_ids=renderer.stop_ids()))[0]
    assert out.completion_ids == base.completion_ids[:j + 1] and out.finish_reason == "stop"
    assert len(out.rollout_logprobs) == j + 1


def test_hf_engine_stops_at_generation_config_eos(tmp_path):
    from rollout.engines.hf import HFEngine
    model_dir = build_foreign_model(str(tmp_path / "m"))
    check_stops(lambda ids, s: HFEngine(model_dir).generate(ids, s), model_dir)


@pytest.mark.slow
def test_vllm_stops_at_generation_config_eos(ray_local, tmp_path):
    from rollout.engines.vllm import VLLMEngine
    from rollout.group import RolloutGroup
    model_dir = build_foreign_model(str(tmp_path / "m"))
    group = RolloutGroup.create(1, dict(model_path=model_dir, max_model_len=128, kv_cache_mb=16), engine_cls=VLLMEngine)
    try:
        check_stops(group.generate, model_dir)
        # text prompts are rendered by the engine with the same renderer: one <s>, the same ids
        sample = group.generate([PROMPT], SamplingConfig(max_new_tokens=2, temperature=0.0))[0]
        assert sample.prompt_ids == PromptRenderer.from_pretrained(model_dir).prompt_ids(PROMPT)
    finally:
        group.shutdown()
