"""Routing replay's engine half (rollout.engines.routes) on the real vLLM engine in a Ray actor: every sample of a
mixture of experts carries the experts each layer routed its tokens to, the same a trainer forward of those tokens
chooses, for prompt tokens a prefix-cache hit skipped as well; a dense model is refused by name."""
import numpy as np
import pytest
import torch

from rollout.engine import SamplingConfig
from rollout.engines.vllm import VLLMEngine
from rollout.group import RolloutGroup

ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_mb=16)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rlhf.config import TinyModelConfig
    from rlhf.weights.tiny import save_tiny_model
    return save_tiny_model(TinyModelConfig(arch="qwen3_moe", num_experts=4, experts_per_token=2),
                           str(tmp_path_factory.mktemp("moe") / "model"))


def _trainer_routes(model, ids: list[int]) -> np.ndarray:
    """(len(ids), layers, k) the experts transformers' routers choose for `ids`, each set sorted."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append(out[2]))
             for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(seen, 1).sort(-1).values.numpy()


def test_each_sample_carries_the_experts_its_tokens_were_routed_to(ray_local, moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    group = RolloutGroup.create(1, dict(model_path=moe_dir, record_routes=True, **ENGINE), timeout_s=300,
                                engine_cls=VLLMEngine)
    try:
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
        first = group.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=1.0, n=2, seed=3))
        again = group.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=1.0, n=1, seed=9))
    finally:
        group.shutdown()
    agree = []
    for s in first + again:  # n=2 shares each prompt's KV; the second call reads the prompts from the prefix cache
        ids = s.prompt_ids + s.completion_ids
        assert s.routes.dtype == np.uint8 and s.routes.shape == (len(ids) - 1, 2, 2)
        own = _trainer_routes(model, ids)[:-1]  # (the last token is never computed in the engine)
        agree.append((np.sort(s.routes, -1) == own).all(-1).mean())
    assert min(agree) >= 0.95, agree  # (fp32 both sides; a near tie may still split one way or the other)


@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_kept_request_carries_its_routes_when_it_ends_across_a_sync(ray_local, moe_dir, multiprocess):
    """Generating ahead (rollout.max_staleness > 0): each kept request's routes come with the delta it ends in, for
    its whole context, though a sync landed mid-generation (unchanged weights here, so one routing throughout), and
    one that ended during an evaluation beside it too (the evaluation's own routes are fetched first); the engine
    core in its own process too (its routes are read once it is paused)."""
    from transformers import AutoModelForCausalLM

    from rollout.engine import Request

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    group = RolloutGroup.create(1, dict(model_path=moe_dir, record_routes=True, multiprocess=multiprocess, **ENGINE),
                                timeout_s=300, engine_cls=VLLMEngine)
    sampling = SamplingConfig(temperature=1.0, seed=5)
    prompts = {30 + i: [4 + i, 9, 11, 20 + i] for i in range(4)}
    ids: dict[int, list] = {k: [] for k in prompts}
    ended = {}
    try:
        new = [Request(k, p, 12, seed=k) for k, p in prompts.items()]
        (answer,), _ = group.advance([new + [Request(40, [5, 6, 7], 3, seed=1)]], sampling, 2, rows=5)
        for d in answer.deltas:
            ids.setdefault(d.key, []).extend(d.ids)
            if d.finish is not None:
                ended[d.key] = d.routes
        # an evaluation beside them: request 40 ends inside it (1 token left), its routes must wait for the next call
        group.generate([[7, 8, 9]], SamplingConfig(max_new_tokens=6, temperature=1.0, seed=2))
        new, prompts = [], {**prompts, 40: [5, 6, 7]}
        for call in range(40):
            (answer,), _ = group.advance([new], sampling, 3, rows=4)
            new = []
            for d in answer.deltas:
                ids[d.key] += d.ids
                if d.finish is not None:
                    ended[d.key] = d.routes
            if call == 1:
                group.update_weights(list(model.state_dict().items()))
            if len(ended) == len(prompts):
                break
    finally:
        group.shutdown()
    assert set(ended) == set(prompts)
    for key, routes in ended.items():
        tokens = prompts[key] + ids[key]
        assert routes.shape == (len(tokens) - 1, 2, 2)
        assert (np.sort(routes, -1) == _trainer_routes(model, tokens)[:-1]).all(-1).mean() >= 0.95


def test_a_multi_turn_trajectory_carries_the_routes_of_its_whole_context(ray_local, moe_dir):
    """Each turn's request computes only what its prefix-cache hit did not hold (the observations since the last
    turn), yet its routes cover the whole conversation: the trajectory takes its last turn's."""
    from transformers import AutoModelForCausalLM

    from common.batch import samples_to_batch
    from common.schema import EnvConfig
    from rollout.multiturn.trajectory import TrajectoryRunner
    from rollout.render import PromptRenderer
    from tests.fixtures.envs import Echo

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    renderer = PromptRenderer.from_pretrained(moe_dir)
    group = RolloutGroup.create(1, dict(model_path=moe_dir, record_routes=True, **dict(ENGINE, max_model_len=256)),
                                timeout_s=300, engine_cls=VLLMEngine)
    try:
        runner = TrajectoryRunner(group, renderer, Echo, EnvConfig(name="tests.fixtures.envs:Echo", max_turns=3),
                                  max_model_len=256)
        samples = runner.run([{"word": "a"}, {"word": "b"}], SamplingConfig(max_new_tokens=6, temperature=1.0, n=2))
    finally:
        group.shutdown()
    for s in samples:
        tokens = s.prompt_ids + s.completion_ids
        last = len(s.prompt_ids) + max(i for i, m in enumerate(s.completion_mask) if m)  # the last sampled token
        assert s.env.turns == 3 and s.routes.shape == (last, 2, 2)
        assert (np.sort(s.routes, -1) == _trainer_routes(model, tokens)[:last]).all(-1).mean() >= 0.95
    routes = samples_to_batch(samples, renderer.pad_id)["routes"]
    assert routes.shape[:2] == (4, max(len(s.prompt_ids) + len(s.completion_ids) for s in samples))


def test_recording_routes_of_a_dense_model_is_refused_by_its_key(ray_local, tiny_model_dir):
    from common.remote import WorkerDied

    with pytest.raises((WorkerDied, RuntimeError, ValueError), match="routing_replay"):
        group = RolloutGroup.create(1, dict(model_path=tiny_model_dir, record_routes=True, **ENGINE), timeout_s=300,
                                    engine_cls=VLLMEngine)
        group.shutdown()


def test_replaying_the_engines_routes_brings_the_trainers_logprobs_to_the_engines(ray_local, moe_dir, tmp_path):
    """A trainer whose routers differ a little from the engine's (noise of 5% of the router weights' scale,
    standing in for another kernel or precision at near ties) sends some tokens to other experts, and its log-probs
    drift from the engine's; replaying the engine's routes removes the part of the drift the routing caused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from actors.policy import PolicyTrainer
    from common.batch import samples_to_batch
    from rlhf.config import TrainerConfig

    group = RolloutGroup.create(1, dict(model_path=moe_dir, record_routes=True, **ENGINE), timeout_s=300,
                                engine_cls=VLLMEngine)
    try:
        samples = group.generate([[5 + i, 17, 23, 9, 31, 40 + i] for i in range(8)],
                                 SamplingConfig(max_new_tokens=16, temperature=1.0, n=4, seed=1))
    finally:
        group.shutdown()
    batch = samples_to_batch(samples, 0)
    nearby = str(tmp_path / "nearby")
    shutil.copytree(moe_dir, nearby)
    weights = load_file(f"{nearby}/model.safetensors")
    noise = torch.Generator().manual_seed(0)
    for k, w in weights.items():
        if k.endswith("mlp.gate.weight"):
            weights[k] = w + 0.05 * w.abs().mean() * torch.randn(w.shape, generator=noise)
    save_file(weights, f"{nearby}/model.safetensors", metadata={"format": "pt"})
    drift, agreement = {}, {}
    for mode in ("measure", "rollout"):
        trainer = PolicyTrainer(nearby, TrainerConfig(lr=1e-5, batch_size=32, micro_batch_size=32),
                                routing_replay=mode)
        logp, mask = trainer.compute_logprobs(batch), batch["loss_mask"]
        drift[mode] = float(((logp - batch["rollout_logprobs"]).abs() * mask).sum() / mask.sum())
        same, seen = trainer.ds.routers.agree
        agreement[mode] = same / seen
    assert agreement["measure"] < 0.99  # the routers disagree on some tokens
    assert drift["rollout"] < 0.3 * drift["measure"], drift
