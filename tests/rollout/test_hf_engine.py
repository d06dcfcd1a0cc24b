"""The transformers fallback engine follows the same protocol, reports the sampled tokens' log-probs and takes weights
over the ipc channel."""
import pytest
import torch

from algorithms.logprobs import token_logprobs
from common.batch import samples_to_batch
from rollout.engine import SamplingConfig
from rollout.engines.hf import HFEngine
from tests.rollout.agreement import logprob_diff


def test_hf_engine_samples_and_logprobs(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine.from_model(model, tok.eos_token_id, tok.pad_token_id, batch_size=4)
    prompts = [tok("sort 3 1 2 =").input_ids, tok("sort 10 7 =").input_ids, tok("sort 5 =").input_ids]
    samples = engine.generate(prompts, SamplingConfig(max_new_tokens=6, temperature=1.0, n=2, seed=3))
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    for s in samples:
        assert len(s.completion_ids) == len(s.rollout_logprobs) <= 6
        assert (s.finish_reason == "stop") == (s.completion_ids[-1] == tok.eos_token_id)
    batch = samples_to_batch(samples, tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1],
                            batch["input_ids"][:, 1:])
    assert logprob_diff(lp, batch) < 1e-4
    # raw log-probs whatever shapes the sampling, gathered step by step (no (B, T, V) of every step's logits)
    asked = {}
    generate = model.generate
    model.generate = lambda **kw: asked.update(kw) or generate(**kw)
    warped = engine.generate(prompts, SamplingConfig(max_new_tokens=6, temperature=0.5, top_p=0.8, n=2, seed=4))
    assert not asked.get("output_logits") and not asked.get("output_scores")
    batch = samples_to_batch(warped, tok.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1],
                            batch["input_ids"][:, 1:])
    assert logprob_diff(lp, batch) < 1e-4
    # tempered: the log-probs of softmax(logits / T), recorded after the temperature (here without a nucleus)
    engine.tempered_logprobs = True
    hot = samples_to_batch(engine.generate(prompts, SamplingConfig(max_new_tokens=6, temperature=0.5, n=2, seed=4)),
                           tok.pad_token_id)
    with torch.no_grad():
        logits = model(hot["input_ids"], attention_mask=hot["attention_mask"]).logits[:, :-1]
    assert logprob_diff(token_logprobs(logits, hot["input_ids"][:, 1:], temperature=0.5), hot) < 1e-4
    assert logprob_diff(token_logprobs(logits, hot["input_ids"][:, 1:]), hot) > 1e-2
    engine.tempered_logprobs = False
    with pytest.raises(ValueError, match="pass token ids"):  # a bare model has no tokenizer
        engine.generate(["sort 3 1 2 ="], SamplingConfig())
    greedy = SamplingConfig(max_new_tokens=6, temperature=0.0)
    assert [s.completion_ids for s in engine.generate(prompts, greedy)] == \
        [s.completion_ids for s in engine.generate(prompts, greedy)]


def test_hf_engine_keeps_requests_across_calls_and_ends_them_at_max_model_len(tiny_model_dir):
    """rollout.engines.inflight on the transformers engine: kept requests advance a few tokens a call, their contexts
    held inside the engine; each ends by its budget, a stop token, or the context's limit ("length")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.engine import Request

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine.from_model(model, tok.eos_token_id, tok.pad_token_id, batch_size=4)
    engine.kept.max_model_len = 16
    sampling = SamplingConfig(temperature=1.0, seed=2)
    prompts = {0: [5, 6, 7], 1: list(range(3, 14)), 2: [8, 9]}  # 1: room for 5 tokens
    got = {k: {"ids": [], "logprobs": [], "finish": None} for k in prompts}
    new = [Request(0, prompts[0], 9), Request(1, prompts[1], 9), Request(2, prompts[2], 9, stop_token_ids=(0,))]
    for _ in range(20):
        for d in engine.advance(new, sampling, steps=2).deltas:
            assert len(d.ids) <= 2
            got[d.key]["ids"] += d.ids
            got[d.key]["logprobs"] += d.logprobs
            got[d.key]["finish"] = d.finish
        new = []
        if all(g["finish"] for g in got.values()):
            break
    assert len(got[1]["ids"]) == 5 and got[1]["finish"] == "length" and not engine.kept.live
    for k, g in got.items():
        assert len(g["ids"]) == 9 or g["finish"] == "stop" or k == 1
        ids = torch.tensor([prompts[k] + g["ids"]])
        with torch.no_grad():
            lp = token_logprobs(model(ids).logits[:, :-1], ids[:, 1:])[0, len(prompts[k]) - 1:]
        assert (lp - torch.tensor(g["logprobs"])).abs().max() < 1e-4


@pytest.mark.slow
def test_hf_engine_follows_the_trainer_over_the_ipc_channel(ray_local, tiny_model_dir):
    from actors.policy import PolicyTrainer
    from common.remote import make_actor, ray_get
    from rlhf.config import TrainerConfig
    from rollout.group import RolloutGroup
    from rollout.sync import setup_sync, sync_weights
    from rollout.sync.buckets import plan_buckets
    from tests.rollout.test_vllm_engine import SAMPLING, prompts_and_batches, remote_diff

    tok, prompts, batches = prompts_and_batches(tiny_model_dir, steps=2)
    tr = TrainerConfig(lr=5e-3, batch_size=16, micro_batch_size=16, warmup_steps=0)
    trainer = make_actor(PolicyTrainer, "trainer", {}, tiny_model_dir, tr)
    group = RolloutGroup.create(1, dict(model_path=tiny_model_dir), engine_cls=HFEngine)
    try:
        plan = plan_buckets(ray_get([trainer.weight_specs.remote()], 60, ["trainer"])[0], bucket_bytes=128 << 10)
        setup_sync("ipc", [trainer], group, plan)
        for batch in batches:
            ray_get([trainer.sft_step.remote(batch)], 300, ["trainer"])
            assert remote_diff(trainer, group.generate(prompts, SAMPLING), tok.pad_token_id) > 1e-2
            sync_weights([trainer], group)
            assert remote_diff(trainer, group.generate(prompts, SAMPLING), tok.pad_token_id) < 1e-4
        texts = [tok.decode(p) for p in prompts]  # text prompts: tokenized by the engine, same samples
        assert [s.completion_ids for s in group.generate(texts, SAMPLING)] == \
            [s.completion_ids for s in group.generate(prompts, SAMPLING)]
    finally:
        group.shutdown()
        ray_local.kill(trainer)
