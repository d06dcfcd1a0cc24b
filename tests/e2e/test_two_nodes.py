"""Two Ray nodes on this machine (`ray.cluster_utils.Cluster`, each with its own logical GPU): the trainer on one,
the vLLM engine on the other. `auto` must fall back from shared memory to broadcast (an explicit `ipc` is an
error), a trained update must reach the remote engine (log-probs agree < 1e-3), and shutting down must leave none
of the processes the test started."""
import pytest

from tests.helpers import ROOT, child_commands


def ray_processes() -> set[int]:
    return {p.pid for p, cmd in child_commands()
            if any(k in cmd for k in ("raylet", "gcs_server", "default_worker", "ray::"))}


@pytest.mark.slow
def test_trainer_and_engine_on_two_nodes(tiny_model_dir):
    import ray
    from ray.cluster_utils import Cluster

    from actors.policy import PolicyTrainer
    from common.errors import UserError
    from common.remote import make_actor, ray_get
    from rlhf.config import TrainerConfig
    from rollout.engines.vllm import VLLMEngine
    from rollout.group import RolloutGroup
    from rollout.sync import sync_channel
    from rollout.sync import setup_sync, sync_weights
    from rollout.sync.buckets import plan_buckets
    from tests.rollout.test_vllm_engine import ENGINE, SAMPLING, prompts_and_batches, remote_diff

    ray.shutdown()  # the session's instance (tests.helpers.session_ray): this test needs its own cluster
    before = ray_processes()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "resources": {"a": 1}})
    cluster.add_node(num_cpus=2, num_gpus=1, resources={"b": 1})
    ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        assert len(ray_processes() - before) >= 2  # the check below can fail: it sees the two raylets
        tok, prompts, batches = prompts_and_batches(tiny_model_dir, steps=1)
        tr = TrainerConfig(lr=5e-3, batch_size=16, micro_batch_size=8, warmup_steps=0)
        trainer = make_actor(PolicyTrainer, "policy trainer 0", {"resources": {"a": 0.5}}, tiny_model_dir, tr)
        group = RolloutGroup.create(1, dict(model_path=tiny_model_dir, **ENGINE), [{"resources": {"b": 0.5}}],
                                    engine_cls=VLLMEngine)
        node = lambda _self: ray.get_runtime_context().get_node_id()  # noqa: E731
        engine_nodes = ray_get([e.__ray_call__.remote(node) for e in group.engines], 60, group.roles)
        assert ray_get([trainer.__ray_call__.remote(node)], 60, ["trainer"]) != engine_nodes
        plan = plan_buckets(ray_get([trainer.weight_specs.remote()], 60, ["trainer"])[0], 256 << 10)
        with pytest.raises(UserError, match="another node than policy trainer 0"):
            setup_sync("ipc", [trainer], group, plan, strict=True)
        channel = sync_channel("auto", "colocate", 0, 1, 1)
        assert channel == "ipc" and setup_sync(channel, [trainer], group, plan, strict=False) == "broadcast"
        ray_get([trainer.sft_step.remote(batches[0])], 300, ["trainer"])
        assert remote_diff(trainer, group.generate(prompts, SAMPLING), tok.pad_token_id) > 1e-2  # stale
        sync_weights([trainer], group)
        assert remote_diff(trainer, group.generate(prompts, SAMPLING), tok.pad_token_id) < 1e-3
        group.shutdown()
        ray.kill(trainer)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert ray_processes() <= before  # nothing it started is left
