"""In-flight generation on the real vLLM engine in a Ray actor (rollout.engines.inflight): a kept request ends at the
engine's max_model_len with "length" (never an error), an evaluation runs beside kept requests and leaves them whole,
and a LoRA adapter sync starts them again under the new adapter from their tokens so far. (A full-weight sync
landing mid-generation, keep and recompute: tests/rollout/test_async_rollout.py.)"""
import os

import numpy as np
import pytest
import torch

from rollout.engine import Request, SamplingConfig
from rollout.engines.vllm import VLLMEngine
from rollout.group import RolloutGroup

ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_mb=16)
SAMPLING = SamplingConfig(temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def group(ray_local, tiny_model_dir):
    g = RolloutGroup.create(1, dict(model_path=tiny_model_dir, max_lora_rank=4, **ENGINE), timeout_s=300,
                            engine_cls=VLLMEngine)
    yield g
    g.shutdown()


def _advance(group, new=(), steps=4) -> dict[int, dict]:
    """One call; key -> {"ids", "logprobs", "finish"}."""
    (answer,), lost = group.advance([list(new)], SAMPLING, steps, rows=8)
    assert lost == []
    return {d.key: {"ids": d.ids, "logprobs": d.logprobs, "finish": d.finish} for d in answer.deltas}


def _until_done(group, kept: dict[int, dict], steps=4) -> None:
    """Advance until every request in `kept` has ended, appending what each produced."""
    for _ in range(200):
        if all(k["finish"] for k in kept.values()):
            return
        for key, d in _advance(group, steps=steps).items():
            kept[key]["ids"] += d["ids"]
            kept[key]["logprobs"] += d["logprobs"]
            kept[key]["finish"] = d["finish"]
    raise AssertionError("kept requests did not end")


def _counts(group) -> np.ndarray:
    """The engine's (prefill, generated) counts now (an advance call starting nothing, no step)."""
    (answer,), _ = group.advance([[]], SAMPLING, 0, rows=1)
    return np.array([answer.prefill_tokens, answer.generated_tokens])


def _forced(model, prompt, ids) -> np.ndarray:
    x = torch.tensor([prompt + ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits[0, :-1].float(), -1)
    return logp[torch.arange(x.shape[1] - 1), x[0, 1:]][len(prompt) - 1:].numpy()


def test_a_kept_request_that_fills_max_model_len_ends_with_length(group):
    long, short = list(range(3, 59)), [5, 6, 7]  # 56 of the 64 positions: room for 8 tokens
    got = _advance(group, [Request(0, long, 30, seed=1), Request(1, short, 12, seed=2),
                           Request(2, list(range(3, 67)), 5, seed=3)])  # already full: ends at once
    assert got[2] == {"ids": [], "logprobs": [], "finish": "length"}
    kept = {k: {"ids": got.get(k, {}).get("ids", []), "logprobs": got.get(k, {}).get("logprobs", []),
                "finish": got.get(k, {}).get("finish")} for k in (0, 1)}
    _until_done(group, kept)
    assert len(kept[0]["ids"]) == 8 and kept[0]["finish"] == "length"
    assert kept[1]["finish"] == "stop" or len(kept[1]["ids"]) == 12
    assert all(len(k["ids"]) == len(k["logprobs"]) for k in kept.values())


def test_an_evaluation_beside_kept_requests_leaves_them_whole(group, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[4 + i, 9, 11] for i in range(6)]
    start = _counts(group)
    got = _advance(group, [Request(10 + i, p, 20, seed=i) for i, p in enumerate(prompts)], steps=3)
    kept = {10 + i: dict(prompt=p, ids=list(got[10 + i]["ids"]), logprobs=list(got[10 + i]["logprobs"]),
                         finish=got[10 + i]["finish"]) for i, p in enumerate(prompts)}
    assert all(len(k["ids"]) == 3 for k in kept.values())  # mid-generation
    greedy = group.generate([[8, 2, 6], [7, 7]], SamplingConfig(max_new_tokens=10, temperature=0.0))
    for s in greedy:  # the evaluation's own samples: whole, greedy, the model's log-probs
        assert len(s.completion_ids) == 10 or s.finish_reason == "stop"
        forced = _forced(model, s.prompt_ids, s.completion_ids)
        assert np.abs(np.asarray(s.rollout_logprobs) - forced).max() < 1e-3
    _until_done(group, kept)
    for k in kept.values():  # what was produced beside the evaluation reached the next call, nothing lost
        assert len(k["ids"]) == 20 or k["finish"] == "stop"
        assert np.abs(np.asarray(k["logprobs"]) - _forced(model, k["prompt"], k["ids"])).max() < 1e-3
    # the engine's counts are the kept samples' own (rollout/prefill_per_token): the evaluation is not in them
    assert (_counts(group) - start).tolist() == [sum(map(len, prompts)), sum(len(k["ids"]) for k in kept.values())]


def _adapter(model_dir: str, out: str):
    """A PEFT LoRA adapter of rank 4 with random (not zero) B: it changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    peft.save_pretrained(out)
    files = {name: open(os.path.join(out, name), "rb").read() for name in os.listdir(out)}
    return peft.eval(), files


def test_a_kept_request_prefills_its_prompt_once_however_many_calls_it_takes(group):
    """The engine's counts (rollout/prefill_per_token): a prompt computed once, then one token a step."""
    (before,), _ = group.advance([[]], SAMPLING, 0, rows=1)
    prompt = [9, 4, 17, 3, 25, 6, 8, 30, 2, 5, 41, 7]  # not seen before: no prefix-cache hit
    kept = {30: {"ids": [], "logprobs": [], "finish": None}}
    got = _advance(group, [Request(30, prompt, 16, seed=7)], steps=2)
    kept[30].update(ids=list(got[30]["ids"]), finish=got[30]["finish"])
    _until_done(group, kept, steps=2)  # eight calls or so, nothing sent but the first
    (after,), _ = group.advance([[]], SAMPLING, 0, rows=1)
    assert after.prefill_tokens - before.prefill_tokens == len(prompt)
    assert after.generated_tokens - before.generated_tokens == len(kept[30]["ids"])


def test_a_lora_adapter_sync_starts_kept_requests_again_under_the_new_adapter(group, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    adapted, files = _adapter(tiny_model_dir, str(tmp_path / "adapter"))
    prompts = [[3 + i, 8, 5] for i in range(4)]
    got = _advance(group, [Request(20 + i, p, 16, seed=i) for i, p in enumerate(prompts)], steps=4)
    before = {20 + i: len(got[20 + i]["ids"]) for i in range(4)}
    assert set(before.values()) == {4}
    (counted,), _ = group.advance([[]], SAMPLING, 0, rows=4)
    group.load_adapter(files)
    kept = {20 + i: dict(prompt=p, ids=list(got[20 + i]["ids"]), logprobs=list(got[20 + i]["logprobs"]),
                         finish=None) for i, p in enumerate(prompts)}
    _until_done(group, kept)
    moved = []
    for key, k in kept.items():
        n, lp = before[key], np.asarray(k["logprobs"])
        assert np.abs(lp[:n] - _forced(base, k["prompt"], k["ids"])[:n]).max() < 1e-3
        after = _forced(adapted, k["prompt"], k["ids"])[n:]  # re-prefilled under the adapter: its log-probs
        assert np.abs(lp[n:] - after).max(initial=0) < 1e-3
        moved.append(np.abs(lp[n:] - _forced(base, k["prompt"], k["ids"])[n:]).mean())
    assert np.mean(moved) > 1e-2  # the adapter changes them: the check above can fail
    (now,), _ = group.advance([[]], SAMPLING, 0, rows=4)  # each context (prompt + 4 tokens) prefilled again, and
    # each sample's first prefill, counted when it ended
    assert now.prefill_tokens - counted.prefill_tokens == sum((len(p) + 4) + len(p) for p in prompts)


def _version_starts(engine) -> dict[str, list]:
    """In the engine's actor: vLLM's own record of which weights sampled each kept request's tokens so far,
    {request id: [(version label, first token index), ...]}."""
    states = engine.llm.llm_engine.output_processor.request_states
    return {rid.rsplit("-", 1)[0]: list(s.weight_version_starts) for rid, s in states.items()}  # (vLLM's suffix)


@pytest.mark.slow
def test_a_multiprocess_engine_core_samples_only_inside_calls(ray_local, tiny_model_dir):
    """GPU review 4, finding 7: an engine core in its own process steps by itself. Left running between calls, it
    samples tokens the next call hands out after a sync, tagged with the new version though the old weights sampled
    them. vLLM labels each token with the weights it was sampled by: the label must change exactly where the driver's
    calls do, however long the driver takes between them."""
    import time

    from transformers import AutoModelForCausalLM

    g = RolloutGroup.create(1, dict(model_path=tiny_model_dir, multiprocess=True, **ENGINE), timeout_s=300,
                            engine_cls=VLLMEngine)
    try:
        got = _advance(g, [Request(20 + i, [4 + i, 9, 11], 50, seed=i) for i in range(4)], steps=3)
        handed = {k: len(d["ids"]) for k, d in got.items() if d["finish"] is None}
        assert handed and all(0 < n <= 4 for n in handed.values())
        time.sleep(1.0)  # the driver busy elsewhere (a train step): a running core would sample on meanwhile
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        g.update_weights(list(model.state_dict().items()))  # a sync: later tokens are version v1's
        more = _advance(g, steps=2)
        starts = ray_local.get(g.engines[0].__ray_call__.remote(_version_starts), timeout=60)
        checked = 0
        for key, n in handed.items():
            if more.get(key, {}).get("ids"):
                assert starts[f"k{key}"] == [("v0", 0), ("v1", n)], (key, n, starts[f"k{key}"])
                checked += 1
        assert checked > 0
        # with requests kept and the core paused between calls, a synchronous generate still runs to its end
        assert len(g.generate([[5, 6, 7]], SAMPLING)) == 1
    finally:
        g.shutdown()
