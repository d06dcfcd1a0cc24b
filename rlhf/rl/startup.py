"""Starting an RL run's workers: which roles it needs and how many ranks each (`role_ranks`), where they go
(`rlhf.rl.placement`), and the Ray actors themselves (`start_workers`), in the order a shared GPU needs."""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from rlhf.config import RunConfig
from rlhf.config.resolve import role_ranks
from rlhf.rl.placement import Placement, describe_placement
from rlhf.weights.tiny import ensure_model

if TYPE_CHECKING:
    from actors.group import ActorGroup, Replicas
    from rollout.group import RolloutGroup


@dataclass
class Workers:
    placement: Placement
    policy: ActorGroup  # of PolicyTrainer (or HybridWorker: trainer and engine in one actor)
    critic: Optional[ActorGroup]  # of Critic (ppo)
    reference: Optional[Replicas]  # of ReferenceModel (a KL term, without LoRA)
    teacher: Optional[Replicas]  # of ReferenceModel on teacher.path (opd)
    reward_model: Optional[Replicas]  # of RewardModel (reward.model_path)
    rollout: RolloutGroup
    lora_reference: bool  # the reference is the policy with its adapter off
    adapter_sync: bool  # LoRA with vLLM: only the adapter is synced
    startup: dict[str, float]


def logprob_temperature(cfg: RunConfig) -> float:
    """The temperature the trainer and reference divide logits by: the sampling one under rollout.tempered_logprobs
    (1 for greedy rollouts, whose log-probs vLLM reports raw)."""
    r = cfg.rollout
    return r.temperature if r.tempered_logprobs and r.temperature > 0 else 1.0


def engine_spec(cfg: RunConfig, placement: Placement, adapter_sync: bool) -> tuple[type, dict]:
    """The engine class and its arguments (besides the model)."""
    r = cfg.rollout
    if r.engine != "vllm":
        from rollout.engines.hf import HFEngine
        return HFEngine, dict(tempered_logprobs=r.tempered_logprobs, max_model_len=r.max_model_len)
    from rollout.engines.vllm import VLLMEngine
    # (hybrid: rollout.multiprocess is resolved false, the engine core in the trainer's process: tensors by reference)
    return VLLMEngine, dict(max_model_len=r.max_model_len, kv_cache_mb=r.kv_cache_mb, seed=cfg.seed,
                            multiprocess=r.multiprocess, gpu_memory_utilization=r.gpu_memory_utilization,
                            enable_sleep=placement.pg is not None and cfg.placement.mode in ("colocate", "hybrid"),
                            max_lora_rank=cfg.model.lora.rank if adapter_sync else 0,
                            # a full sync rewrites every weight: nothing to keep while asleep (level 2)
                            sleep_level=1 if adapter_sync else 2, tempered_logprobs=r.tempered_logprobs,
                            inflight_kv=r.inflight_kv, tensor_parallel_size=r.tensor_parallel_size,
                            record_routes=cfg.stage == "rl" and cfg.algorithm.routing_replay != "off")


def start_workers(cfg: RunConfig, model_path: str, needs_critic: bool) -> Workers:
    """Every role starts at once, except engines that share a GPU with other roles (colocated on GPUs): those start
    only once every other model is loaded, since vLLM counts what the GPU allocates during its start-up profiling
    as its own, so a reference model loading meanwhile would shrink its KV cache. Under `placement.mode: hybrid`
    the engines start inside the policy ranks (actors.hybrid), so on GPUs those ranks start last. `time/start_trainers`
    is the wait for trainers and scorers, `time/start_engines` the further wait for the engines (hybrid: on CPU
    nothing, on GPUs the policy ranks with their engines)."""
    from actors.critic import Critic
    from actors.group import ActorGroup
    from rollout.group import RolloutGroup

    m, ranks, start = cfg.model, role_ranks(cfg, needs_critic), time.perf_counter()
    tp = {"rollout": cfg.rollout.tensor_parallel_size}
    placement = Placement(cfg.placement.mode, cfg.placement.num_gpus, ranks, threads=cfg.placement.cpu_threads,
                          gpus_per_rank=tp)
    print(describe_placement(cfg.placement.mode, cfg.placement.num_gpus, ranks, tp, tp), flush=True)
    common = dict(dtype=m.dtype, trust_remote_code=m.trust_remote_code)
    adapter_sync = m.lora.rank > 0 and cfg.rollout.engine == "vllm" and cfg.rollout.lora_sync == "adapter"
    engine_cls, engine_kwargs = engine_spec(cfg, placement, adapter_sync)
    hybrid = cfg.placement.mode == "hybrid"

    def start_engines(policy) -> RolloutGroup:
        if hybrid:  # the policy ranks host the engines
            return RolloutGroup(policy.actors, cfg.rollout.timeout_s, in_trainers=True)
        return RolloutGroup.start(cfg.rollout.num_engines, dict(model_path=model_path, **common, **engine_kwargs),
                                  placement.options["rollout"], engine_cls=engine_cls,
                                  timeout_s=cfg.rollout.timeout_s, max_restarts=cfg.rollout.max_engine_restarts)

    def start_policy():
        return start_policy_ranks(cfg, model_path, placement, common, (engine_cls, {**common, **engine_kwargs})
                                  if hybrid else None)

    shares_gpu = cfg.placement.num_gpus > 0 and cfg.placement.mode in ("colocate", "hybrid")
    rollout = None if shares_gpu or hybrid else start_engines(None)
    reward_model, reference, teacher = start_scorers(cfg, model_path, placement, ranks, common)
    policy = None if shares_gpu and hybrid else start_policy()
    critic = (ActorGroup(Critic, "critic", cfg.trainer.world_size, placement.options["critic"],
                         sequence_parallel=cfg.trainer.sequence_parallel_size,
                         model_path=model_path, tr=replace(cfg.trainer, lr=cfg.algorithm.critic_lr),
                         seed=cfg.seed, **common) if "critic" in ranks else None)
    for scorer in (reward_model, reference, teacher):  # (ActorGroups wait for their ranks already)
        if scorer is not None:
            scorer.ready()
    engines_start = time.perf_counter()
    policy = policy or start_policy()
    rollout = rollout or start_engines(policy)
    rollout.ready()
    startup = {"time/start_trainers": engines_start - start,  # logged with step 0
               "time/start_engines": time.perf_counter() - engines_start, **agreed_dtypes(cfg, policy, rollout)}
    return Workers(placement, policy, critic, reference, teacher, reward_model, rollout,
                   lora_reference=cfg.algorithm.kl_mode() != "off" and m.lora.rank > 0, adapter_sync=adapter_sync,
                   startup=startup)


def agreed_dtypes(cfg: RunConfig, policy, rollout) -> dict[str, str]:
    """The dtypes the engines loaded and the trainers compute in, as the workers report them (the first metrics row
    records them); engines that did not load model.dtype would sample from other numbers than the trainer scores."""
    engines = sorted(set(rollout.weights_dtypes()))
    if engines != [cfg.model.dtype]:
        raise RuntimeError(f"the rollout engines loaded {engines}, not model.dtype {cfg.model.dtype}")
    trainers = sorted(set(policy.matmul_dtypes()))
    return {"run/engine_dtype": engines[0], "run/trainer_dtype": ",".join(trainers)}


def start_policy_ranks(cfg: RunConfig, model_path: str, placement: Placement, common: dict,
                       hybrid_engine: Optional[tuple[type, dict]]):
    """The policy's ActorGroup (it waits for every rank): PolicyTrainer ranks, or HybridWorker ranks each hosting
    `hybrid_engine = (engine class, its arguments)`."""
    from actors.group import ActorGroup
    from actors.hybrid import HybridWorker
    from actors.policy import PolicyTrainer

    cls, extra = PolicyTrainer, {}
    if hybrid_engine is not None:
        cls, extra = HybridWorker, dict(engine_cls=hybrid_engine[0], engine_kwargs=hybrid_engine[1])
    return ActorGroup(cls, "policy trainer", cfg.trainer.world_size, placement.options["policy"],
                      sequence_parallel=cfg.trainer.sequence_parallel_size,
                      model_path=model_path, tr=cfg.trainer, seed=cfg.seed, lora=cfg.model.lora,
                      logprob_temperature=logprob_temperature(cfg), routing_replay=cfg.algorithm.routing_replay,
                      **common, **extra)


def start_scorers(cfg: RunConfig, model_path: str, placement: Placement, ranks: dict[str, int],
                  common: dict) -> tuple:
    """The reward model, reference and teacher copies (Replicas, loading in the background), each None when not
    needed."""
    from actors.group import Replicas
    from actors.reference import ReferenceModel
    from actors.reward_model import RewardModel

    m, tr = cfg.model, cfg.trainer
    # scorers cut their micro-batches as the trainer does: its row count, or its padded-token budget
    sizes = dict(micro_batch_size=tr.micro_batch_size, max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch)
    reward_model = (Replicas(RewardModel, "reward model", placement.options["reward"],
                             ensure_model(cfg.reward.model_path, m.tiny, cfg.output_dir, cfg.seed), **sizes, **common)
                    if "reward" in ranks else None)
    scoring = dict(logprob_temperature=logprob_temperature(cfg), chunked_logprobs=tr.chunked_logprobs, **sizes)
    reference = (Replicas(ReferenceModel, "reference model", placement.options["reference"], model_path,
                          precision=tr.precision, **scoring, **common)
                 if "reference" in ranks else None)
    # (teacher.path was checked against the student by the controller, before Ray started: check_teacher)
    teacher = (Replicas(ReferenceModel, "teacher", placement.options["teacher"], cfg.teacher.path, **scoring,
                        **common)
               if "teacher" in ranks else None)
    return reward_model, reference, teacher


def check_teacher(cfg: RunConfig, student: str) -> None:
    """Refuse a teacher.path that is not a model folder with the student's tokenizer (its log-probs are read on the
    student's token ids) and at least as many embedding rows (the student may sample any of its rows; a larger model
    of the same family often pads more: Qwen2.5-7B has 152,064 rows to 0.5B's 151,936)."""
    import json
    import os

    from common.errors import UserError
    path, sizes = cfg.teacher.path, []
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UserError(f"teacher.path = {path!r}: no config.json there; point it at a local Hugging Face model folder "
                        "(e.g. the `final` folder an earlier run wrote)")
    for folder in (path, student):
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            sizes.append(json.load(f).get("vocab_size"))
    vocabs = [_vocab(folder, name, cfg.model.trust_remote_code)
              for folder, name in ((path, "teacher.path"), (student, "model.path"))]
    if vocabs[0] != vocabs[1]:
        differ = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()))[:3]
        raise UserError(f"teacher.path = {path!r}: its tokenizer is not the student's ({student}; e.g. "
                        f"{differ}); distillation reads the teacher on the student's token ids, so both need the same "
                        "tokenizer")
    if None not in sizes and sizes[0] < sizes[1]:
        raise UserError(f"teacher.path = {path!r}: its embedding has {sizes[0]} rows, the student's ({student}) "
                        f"{sizes[1]}; a student token beyond the teacher's rows could not be scored. Use a teacher "
                        "with at least the student's vocab_size")


def _vocab(folder: str, key: str, trust_remote_code: bool) -> dict[str, int]:
    import os

    from transformers import AutoTokenizer

    from common.errors import UserError
    fix = "distillation compares the teacher's and the student's tokenizers, so the folder needs its tokenizer files"
    if not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        raise UserError(f"{key} = {folder!r}: no tokenizer loads from it (none of {', '.join(TOKENIZER_FILES)}); "
                        + fix)
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code).get_vocab()
    except (OSError, ValueError) as e:
        raise UserError(f"{key} = {folder!r}: no tokenizer loads from it ({type(e).__name__}: {e}); " + fix) from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
