"""Typed run configuration: dataclasses loaded as an OmegaConf structured config, plus one validate().

`load_config(path, overrides)` merges the dataclass defaults, the YAML file and `key=value` overrides, turns every
OmegaConf/YAML failure into a `UserError` that names the file, line and dotted key, and then runs `validate()`,
which reports every cross-field problem at once. The user's values are never rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf

from common.errors import UserError
from common.options import (PRECISIONS, AgentConfig, AlgorithmConfig, EnvConfig, LoraConfig, RewardConfig,
                            TrainerConfig)
from rlhf.config_io import key_lines, load_yaml, merge, parse_overrides, to_object
from rlhf.config_algorithm import POLICY_LOSSES, validate_objective
from rlhf.config_gpu import validate_gpu
from rlhf.config_rollout import validate_async, validate_env, validate_sync
from rlhf.tasks import TASKS
from rollout.rewards import BUILTIN as BUILTIN_REWARDS

REWARD_NAMES = tuple(BUILTIN_REWARDS)

STAGES = ("sft", "rl", "dpo", "rm")
ALGORITHMS = ("grpo", "rloo", "reinforce_pp", "ppo", "opd")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")  # algorithms/kl.py (not imported here: config loads without torch)
LOSS_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ENGINES = ("vllm", "hf")
LORA_SYNC, SYNC_CHANNELS = ("adapter", "merged"), ("auto", "broadcast", "ipc")
INFLIGHT_KV = ("keep", "recompute")  # rollout.inflight
PLACEMENT_MODES = ("colocate", "hybrid", "split")
DTYPES = ("float32", "bfloat16", "float16")
ARCHS = ("qwen2", "llama")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# the keys whose value is one of a fixed set: validate() checks them, --help-config lists them
CHOICES = {"stage": STAGES, "model.dtype": DTYPES, "model.tiny.arch": ARCHS, "algorithm.name": ALGORITHMS,
           "trainer.precision": PRECISIONS, "algorithm.kl_estimator": KL_ESTIMATORS, "algorithm.loss_agg": LOSS_AGG,
           "rollout.engine": ENGINES, "rollout.lora_sync": LORA_SYNC, "rollout.sync_channel": SYNC_CHANNELS,
           "placement.mode": PLACEMENT_MODES, "trainer.zero_stage": (0, 1, 2, 3),
           "algorithm.dpo_loss": ("sigmoid", "ipo", "hinge"), "env.observation_role": ("user", "tool"),
           "algorithm.policy_loss": POLICY_LOSSES, "algorithm.rollout_correction": ("token", "sequence"),
           "rollout.inflight_kv": INFLIGHT_KV}
# Engine and trainer kernels round differently: ~1e-6 apart in fp32, ~1e-2 in 16-bit types. A stale weight or
# prefix cache shows up as 1e-1 and more.
LOGPROB_DIFF_WARN = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # what vLLM's attention kernels support


@dataclass
class TinyModelConfig:
    """A randomly initialised model built locally when `model.path` is unset (nothing can be downloaded)."""

    arch: str = "qwen2"  # the transformers architecture the tiny model is built as
    hidden_size: int = 128  # its width; hidden_size / num_heads must be a head size vLLM supports
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    intermediate_size: int = 256  # MLP width
    max_position_embeddings: int = 256  # the longest sequence it can take


@dataclass
class ModelConfig:
    path: Optional[str] = None  # a local Hugging Face folder; unset = build the tiny model into <output_dir>
    # the weights' dtype in the trainers (DeepSpeed: fp32 master weights under bfloat16) and the engines
    dtype: str = "float32"
    trust_remote_code: bool = False  # run the checkpoint folder's own modelling code (transformers and vLLM)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    task: Optional[str] = "sort"  # a built-in synthetic task, or null to read train_path/eval_path
    train_path: Optional[str] = None  # JSONL, Parquet, or a `datasets` folder saved with save_to_disk
    eval_path: Optional[str] = None  # held-out rows, the same format; evaluation uses them
    prompt_key: str = "prompt"  # a string, or a list of {role, content} messages; dotted keys reach nested columns
    answer_key: str = "answer"  # optional for RL prompts: reward functions receive it as `answer` when present
    messages_key: str = "messages"  # SFT data as whole conversations (loss on assistant turns), when no prompt
    apply_chat_template: bool = False  # wrap string prompts as one user message in the checkpoint's chat template
    # a chat template for a checkpoint without one (a base model): gemma, chatml or a Jinja file; saved with the
    # tokenizer into every model folder the run writes (rollout/chat_templates.py)
    chat_template: Optional[str] = None
    chosen_key: str = "chosen"  # preference data (reward model, DPO)
    rejected_key: str = "rejected"  # preference data: the dispreferred answer
    num_train: int = 4096  # synthetic tasks only
    num_eval: int = 64  # synthetic tasks only: held-out rows
    min_items: int = 3  # sort: how many numbers; add: how many digits per operand
    max_items: int = 5  # the upper bound of min_items' range
    max_value: int = 99  # sort only: numbers are drawn from [0, max_value]


@dataclass
class PlacementConfig:
    # colocate: all roles share the GPUs | hybrid: as colocate, each rollout engine inside its trainer rank's
    # process (one engine per rank, synced by reference) | split: each role its own GPUs
    mode: str = "colocate"
    num_gpus: int = 0  # 0 = CPU only (no GPU requests)
    # copies of the reference model, each scoring a share of the rows; null = one beside every trainer rank when
    # colocated on GPUs (no extra GPU), else 1 (under split each copy takes a whole GPU)
    reference_ranks: Optional[int] = None
    # torch threads of each worker process; null = $OMP_NUM_THREADS where set, else this host's cores shared by the
    # workers that compute at the same time (the trainer ranks, or the engines: the phases take turns)
    cpu_threads: Optional[int] = None


@dataclass
class RolloutConfig:
    engine: str = "vllm"  # vllm | hf (transformers generate, for hosts without vLLM)
    num_engines: int = 1  # rollout engines, each a Ray actor (data parallel: prompts are split across them)
    prompts_per_step: int = 16  # prompts each step samples from; n_samples completions each
    n_samples: int = 8  # completions per prompt
    temperature: float = 1.0  # sampling temperature of the rollouts
    top_p: float = 1.0  # nucleus sampling; 1 = off
    # log-probs (the engines', old, trained, reference) of the distribution sampled from, softmax(logits / temperature),
    # as TRL, verl and OpenRLHF train; false = of the raw logits (the ratio then compares other distributions than the
    # one sampled when temperature != 1). With top_p < 1 vLLM's also renormalise over the nucleus (the trainer's don't)
    tempered_logprobs: bool = True
    max_new_tokens: int = 16  # the completion budget; a completion cut there has finish_reason "length"
    max_model_len: int = 256  # prompt + completion tokens an engine accepts (its KV cache is sized for it)
    kv_cache_mb: int = 64  # CPU KV cache size per engine
    gpu_memory_utilization: Optional[float] = None  # an engine's GPU share; null = 0.5 beside a trainer, 0.9 split
    multiprocess: Optional[bool] = None  # vLLM's multiprocess engine core; null = on GPUs only (slow start on CPU)
    sync_bucket_mb: int = 64  # the weight sync's bucket size; a larger tensor is sent in parts
    # auto: ipc where every engine can map its trainer rank's memory (same host; on GPUs, the same GPU), else
    # broadcast | broadcast: torch.distributed from trainer rank 0 | ipc: shared memory / CUDA IPC
    sync_channel: str = "auto"
    lora_sync: str = "adapter"  # with LoRA and vLLM: adapter (send only the adapter) | merged (full merged weights)
    # warn when mean |rollout - trainer log-prob| exceeds this; null = by model.dtype (LOGPROB_DIFF_WARN)
    logprob_diff_warn: Optional[float] = None
    # asynchronous RL: the engines generate ahead while the trainer trains, a sample's oldest token at most this many
    # updates behind the trained weights (paced: nothing is discarded); 0 = generate, then train (docs/async.md)
    max_staleness: int = 0
    chunk_tokens: int = 32  # max_staleness > 0: samples stay in their engine across syncs, advanced this much a call
    inflight_kv: str = "keep"  # what they continue on after a sync: keep (their KV so far) | recompute (re-prefill)
    # an engine whose process dies (OOM, preemption) is restarted up to this many times: the current weights are
    # pushed into it and its share of the generation is redone (rollout/engine_restarts); 0 = a death ends the run
    max_engine_restarts: int = 3
    # a sampling seed per prompt: rollouts reproducible whatever the batching (and a resumed run's rollouts equal an
    # uninterrupted one's); null = on CPU only: on GPUs vLLM then samples every row in one batched kernel
    seed_per_prompt: Optional[bool] = None
    # seconds any one engine call may take (a generation, a weight sync) before the run stops naming the engine;
    # null = 600, and for a generation 0.05 s more per token its busiest engine may have to produce
    timeout_s: Optional[float] = None
    # check every N-th weight sync: each engine received, bit for bit, what its trainer rank sent (both ends
    # fingerprint every tensor, rollout.sync.check); a difference stops the run naming the tensor. 0 = off
    verify_sync_every: int = 0


@dataclass
class TeacherConfig:
    path: Optional[str] = None  # algorithm.name=opd: the teacher's HF folder (its tokenizer must be the student's)


@dataclass
class EvalConfig:
    every: int = 50  # steps between evaluations; 0 = only before and after training; -1 = never
    max_new_tokens: int = 32  # the completion budget of evaluation
    n_samples: int = 1  # > 1: also sample this many completions per prompt and report eval/pass@k
    temperature: float = 1.0  # sampling temperature of those samples (the greedy pass is always temperature 0)


@dataclass
class CheckpointConfig:
    every: int = 10  # steps between checkpoints (stage rl); 0 = only at the end
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    resume: bool = True  # rerunning the same command continues from the newest complete checkpoint


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # write TensorBoard events to <output_dir>/tensorboard
    wandb_project: Optional[str] = None  # logs to W&B when set and wandb is installed
    console_every: int = 10  # print a metrics line every N steps
    rollouts_every: int = 0  # stage rl: every N steps append samples to <output_dir>/rollouts.jsonl; 0 = never
    rollouts_per_step: int = 8  # how many samples (the first of that step's rollout) each dump holds


@dataclass
class RunConfig:
    stage: str = "sft"  # what the run trains: supervised, a reward model, DPO, or RL with rollouts
    output_dir: str = "runs/default"  # metrics, checkpoints and the final model go here; a rerun resumes from it
    seed: int = 0  # model initialisation, data order and sampling
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # stage rl, algorithm.name=opd
    env: EnvConfig = field(default_factory=EnvConfig)  # stage rl: multi-turn rollouts (rollout.env)
    agent: AgentConfig = field(default_factory=AgentConfig)  # stage rl: agents through an endpoint (rollout.agent)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def load_config(path: Optional[str], overrides: list[str] = ()) -> RunConfig:
    """Defaults <- YAML file <- dotted overrides, then validate(); any problem raises UserError."""
    merged = OmegaConf.structured(RunConfig)
    if path is not None:
        merged = merge(merged, load_yaml(path, RunConfig), RunConfig, source=path, lines=key_lines(path))
    merged = merge(merged, parse_overrides(overrides), RunConfig, source="command-line override", lines={})
    cfg = to_object(merged, path)
    problems = validate(cfg)
    if problems:
        where = f" in {path}" if path else ""
        raise UserError(f"{len(problems)} problem(s) in the config{where}:\n  " + "\n  ".join(problems))
    return cfg


def logprob_diff_warn(cfg: RunConfig) -> float:
    """`rollout.logprob_diff_warn`, or the default for `model.dtype`."""
    r = cfg.rollout.logprob_diff_warn
    return r if r is not None else LOGPROB_DIFF_WARN[cfg.model.dtype]


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def validate(cfg: RunConfig) -> list[str]:
    """Every cross-field problem, each as 'dotted.key = value: what is wrong. how to fix it'."""
    p: list[str] = []

    def bad(key: str, value: Any, why: str) -> None:
        p.append(f"{key} = {value!r}: {why}")

    def choice(key: str, value: Any, allowed: tuple) -> None:
        if value not in allowed:
            bad(key, value, f"must be one of {', '.join(map(str, allowed))}")

    def positive(key: str, value: float) -> None:
        if value <= 0:
            bad(key, value, "must be > 0")

    choice("stage", cfg.stage, STAGES)
    for part in (_validate_model, _validate_trainer, _validate_outputs):
        part(cfg, bad, choice, positive)
    _validate_data(cfg.data, bad, choice, positive)
    if cfg.stage == "rl":
        _validate_rl(cfg, bad, choice, positive)
    if cfg.stage in ("dpo", "rm"):
        _validate_preference(cfg, bad, choice, positive)
    validate_gpu(cfg, bad)
    return p


def _validate_model(cfg: RunConfig, bad, choice, positive) -> None:
    m, t = cfg.model, cfg.model.tiny
    choice("model.dtype", m.dtype, DTYPES)
    choice("model.tiny.arch", t.arch, ARCHS)
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                 "max_position_embeddings"):
        positive(f"model.tiny.{name}", getattr(t, name))
    if t.num_heads > 0 and t.hidden_size % t.num_heads:
        bad("model.tiny.hidden_size", t.hidden_size, f"must be divisible by model.tiny.num_heads={t.num_heads}")
    elif t.num_heads > 0 and t.hidden_size // t.num_heads not in VLLM_HEAD_DIMS:
        bad("model.tiny.hidden_size", t.hidden_size, f"gives head size {t.hidden_size // t.num_heads} "
            f"(hidden_size / num_heads), which vLLM cannot run; choose one of {VLLM_HEAD_DIMS}")
    if t.num_kv_heads > 0 and t.num_heads % t.num_kv_heads:
        bad("model.tiny.num_heads", t.num_heads, f"must be divisible by model.tiny.num_kv_heads={t.num_kv_heads}")


def _validate_trainer(cfg: RunConfig, bad, choice, positive) -> None:
    tr = cfg.trainer
    for name in ("lr", "batch_size", "micro_batch_size", "max_steps", "grad_clip"):
        positive(f"trainer.{name}", getattr(tr, name))
    if tr.warmup_steps < 0 or tr.weight_decay < 0 or tr.max_bad_steps < 0:
        bad("trainer.warmup_steps/weight_decay/max_bad_steps", (tr.warmup_steps, tr.weight_decay, tr.max_bad_steps),
            "must be >= 0")
    positive("trainer.world_size", tr.world_size)
    if cfg.placement.cpu_threads is not None:
        positive("placement.cpu_threads", cfg.placement.cpu_threads)
    if tr.max_tokens_per_micro_batch is not None:
        positive("trainer.max_tokens_per_micro_batch", tr.max_tokens_per_micro_batch)
    if tr.packing and cfg.stage == "rm":
        bad("trainer.packing", True, "the reward model scores each row's last token, so its rows stay padded; "
            "set it to false (packing applies to the sft, dpo and rl stages)")
    if tr.shared_prefix and (tr.packing or cfg.stage == "rm" or tr.attn_implementation not in (None, "sdpa", "eager")):
        bad("trainer.shared_prefix", True, "needs trainer.packing: false, a per-token model (not the rm stage) and "
            "sdpa or eager attention (its 4D mask); set it to false or change those")
    if tr.precision is not None:
        choice("trainer.precision", tr.precision, PRECISIONS)
    if tr.attn_implementation is not None and "/" not in tr.attn_implementation:  # a/b: a kernel from the Hub
        choice("trainer.attn_implementation", tr.attn_implementation, ATTN_IMPLEMENTATIONS)
    if tr.micro_batch_size > 0 and tr.world_size > 0 and tr.batch_size % (tr.micro_batch_size * tr.world_size):
        bad("trainer.batch_size", tr.batch_size, f"must be a multiple of trainer.micro_batch_size x "
            f"trainer.world_size = {tr.micro_batch_size * tr.world_size}")
    if cfg.stage != "rl" and tr.world_size != 1:
        bad("trainer.world_size", tr.world_size, f"the {cfg.stage} stage trains in one process; set it to 1")
    lora = cfg.model.lora
    if lora.rank < 0 or lora.alpha <= 0 or not 0 <= lora.dropout < 1 or (lora.rank and not lora.target_modules):
        bad("model.lora", f"rank={lora.rank} alpha={lora.alpha} dropout={lora.dropout}",
            "need rank >= 0 (0 = off), alpha > 0, 0 <= dropout < 1 and at least one target module")
    if lora.rank > 0 and cfg.stage in ("rm", "dpo"):
        bad("model.lora.rank", lora.rank, f"the {cfg.stage} stage trains full weights; set it to 0")
    choice("placement.mode", cfg.placement.mode, PLACEMENT_MODES)
    if cfg.placement.num_gpus < 0:
        bad("placement.num_gpus", cfg.placement.num_gpus, "must be >= 0 (0 = CPU only)")
    choice("trainer.zero_stage", tr.zero_stage, (0, 1, 2, 3))
    if tr.offload and (tr.zero_stage == 0 or cfg.stage != "rl"):
        bad("trainer.offload", True, "moves DeepSpeed's ZeRO states between the phases of stage rl: set "
            "trainer.zero_stage to 1, 2 or 3 (and stage: rl), or offload=false")
    if tr.offload and tr.zero_stage == 3 and cfg.placement.num_gpus == 0:
        bad("trainer.offload", True, "ZeRO-3 offloads only with DeepSpeed's FusedAdam, a GPU op; on CPU there is "
            "nothing to free anyway: set offload=false (or zero_stage 1-2)")


def _validate_preference(cfg: RunConfig, bad, choice, positive) -> None:
    if cfg.stage == "dpo":
        choice("algorithm.dpo_loss", cfg.algorithm.dpo_loss, ("sigmoid", "ipo", "hinge"))
        positive("algorithm.beta", cfg.algorithm.beta)
        if not 0 <= cfg.algorithm.label_smoothing < 0.5:
            bad("algorithm.label_smoothing", cfg.algorithm.label_smoothing, "must be in [0, 0.5)")
        if cfg.algorithm.label_smoothing and cfg.algorithm.dpo_loss != "sigmoid":
            bad("algorithm.label_smoothing", cfg.algorithm.label_smoothing, "applies to dpo_loss=sigmoid only (ipo "
                "and hinge have no label noise term); set it to 0 or dpo_loss=sigmoid")
    if cfg.trainer.micro_batch_size % 2:
        bad("trainer.micro_batch_size", cfg.trainer.micro_batch_size, "counts sequences and must be even for "
            "preference pairs (chosen and rejected stay in the same micro-batch)")


def _validate_outputs(cfg: RunConfig, bad, choice, positive) -> None:
    """The reward function's name, evaluation, logging and checkpoint settings."""
    fn = cfg.reward.fn
    if fn is not None and fn not in REWARD_NAMES and (fn.count(":") != 1 or not all(fn.split(":"))):
        bad("reward.fn", fn, f"write it as 'package.module:function', or name a built-in reward: "
            f"{', '.join(REWARD_NAMES)}")
    url = cfg.reward.url
    if url is not None and (not url.startswith(("http://", "https://")) or fn is not None):
        bad("reward.url", url, "must be an http:// or https:// address of a reward service, and reward.fn unset")
    for key in ("url_batch", "url_concurrency"):
        positive(f"reward.{key}", getattr(cfg.reward, key))
    if cfg.eval.every < -1:
        bad("eval.every", cfg.eval.every, "must be >= -1 (0 evaluates only before and after training, -1 never)")
    positive("eval.max_new_tokens", cfg.eval.max_new_tokens)
    positive("eval.n_samples", cfg.eval.n_samples)
    if cfg.eval.n_samples > 1 and cfg.eval.temperature <= 0:
        bad("eval.temperature", cfg.eval.temperature, "must be > 0 when eval.n_samples > 1 (greedy samples are "
            "all the same); the greedy pass runs anyway")
    positive("logging.console_every", cfg.logging.console_every)
    if cfg.logging.rollouts_every < 0 or cfg.logging.rollouts_per_step < 1:
        bad("logging.rollouts_every/rollouts_per_step", (cfg.logging.rollouts_every, cfg.logging.rollouts_per_step),
            "need rollouts_every >= 0 (0 = no dumps) and rollouts_per_step >= 1")
    positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    if cfg.checkpoint.every < 0:
        bad("checkpoint.every", cfg.checkpoint.every, "must be >= 0 (0 = only at the end)")


def _validate_rl(cfg: RunConfig, bad, choice, positive) -> None:
    a, r = cfg.algorithm, cfg.rollout
    choice("algorithm.name", a.name, ALGORITHMS)
    choice("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    choice("algorithm.loss_agg", a.loss_agg, LOSS_AGG)
    choice("rollout.engine", r.engine, ENGINES)
    choice("rollout.lora_sync", r.lora_sync, LORA_SYNC)
    choice("rollout.sync_channel", r.sync_channel, SYNC_CHANNELS)
    if a.oversample < 1:
        bad("algorithm.oversample", a.oversample, "must be >= 1 (prompts generated per round / prompts_per_step)")
    validate_async(cfg, bad, positive)
    validate_sync(cfg, bad)
    validate_env(cfg, bad, choice, positive)
    validate_objective(cfg, bad, choice)
    for key, value in (("algorithm.clip_low", a.clip_low), ("algorithm.clip_high", a.clip_high),
                       ("algorithm.ppo_epochs", a.ppo_epochs), ("rollout.num_engines", r.num_engines),
                       ("rollout.prompts_per_step", r.prompts_per_step), ("rollout.n_samples", r.n_samples),
                       ("rollout.max_new_tokens", r.max_new_tokens), ("rollout.sync_bucket_mb", r.sync_bucket_mb)):
        positive(key, value)
    if r.timeout_s is not None:
        positive("rollout.timeout_s", r.timeout_s)
    if r.verify_sync_every < 0:
        bad("rollout.verify_sync_every", r.verify_sync_every, "must be >= 0 (0 = off, N = every N-th sync)")
    if r.max_engine_restarts < 0:
        bad("rollout.max_engine_restarts", r.max_engine_restarts, "must be >= 0 (0: a dead engine ends the run)")
    if r.logprob_diff_warn is not None and r.logprob_diff_warn <= 0:
        bad("rollout.logprob_diff_warn", r.logprob_diff_warn, "must be > 0, or null for the dtype's default")
    if r.temperature < 0 or not 0 < r.top_p <= 1:
        bad("rollout.temperature/top_p", (r.temperature, r.top_p), "need temperature >= 0 and 0 < top_p <= 1")
    rollout_batch = r.prompts_per_step * r.n_samples
    if cfg.trainer.batch_size > 0 and rollout_batch % cfg.trainer.batch_size:
        bad("trainer.batch_size", cfg.trainer.batch_size, f"must divide the rollout batch rollout.prompts_per_step x "
            f"rollout.n_samples = {rollout_batch}; it is the mini-batch of each optimizer step")


def _validate_data(d: DataConfig, bad, choice, positive) -> None:
    if d.task is None:
        if d.train_path is None:
            bad("data.train_path", None, "set it to a JSONL/Parquet file or datasets folder, or set data.task "
                f"to one of {', '.join(TASKS)}")
    else:
        choice("data.task", d.task, tuple(TASKS))
        for name in ("num_train", "num_eval", "min_items", "max_value"):
            positive(f"data.{name}", getattr(d, name))
        if d.max_items < d.min_items:
            bad("data.max_items", d.max_items, f"must be >= data.min_items={d.min_items}")
