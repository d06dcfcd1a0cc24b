"""The run's configuration as data: one dataclass a section, composed into `RunConfig` (the trainer, algorithm,
LoRA, environment, reward and agent sections are common/options.py's, the objects workers receive). A key whose
value is one of a fixed set declares it with `one_of`; `CHOICES` is read from those declarations. Nothing here
imports the engines, the trainers or the user's code."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from common.options import (ALGORITHMS, KL_ESTIMATORS, LOSS_AGG, POLICY_LOSSES, PRECISIONS, AgentConfig,
                            AlgorithmConfig, EnvConfig, LoraConfig, RewardConfig, TrainerConfig, one_of)

__all__ = ["ALGORITHMS", "KL_ESTIMATORS", "LOSS_AGG", "POLICY_LOSSES", "PRECISIONS"]  # re-exported for readers

STAGES = ("sft", "rl", "dpo", "rm")
TASK_NAMES = ("sort", "add", "guess")  # rlhf/stages/tasks.py's TASKS (a test compares)
REWARD_NAMES = ("sort", "add", "math", "guess")  # rollout/rewards.py's BUILTIN (a test compares)
ENGINES = ("vllm", "hf")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ARCHS = ("qwen2", "llama")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# Engine and trainer kernels round differently: ~1e-6 apart in fp32, ~1e-2 in 16-bit types. A stale weight or
# prefix cache shows up as 1e-1 and more.
LOGPROB_DIFF_WARN = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # what vLLM's attention kernels support


@dataclass
class TinyModelConfig:
    """A randomly initialised model built locally when `model.path` is unset (nothing can be downloaded)."""

    arch: str = one_of("qwen2", *ARCHS)  # the transformers architecture the tiny model is built as
    hidden_size: int = 128  # its width; hidden_size / num_heads must be a head size vLLM supports
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    intermediate_size: int = 256  # MLP width
    max_position_embeddings: int = 256  # the longest sequence it can take


@dataclass
class ModelConfig:
    path: Optional[str] = None  # a local Hugging Face folder; unset = build the tiny model into <output_dir>
    # the weights' dtype in the trainers (DeepSpeed: fp32 master weights under bfloat16) and the engines; auto =
    # bfloat16 where the device runs it fast (CUDA 8.0+; a CPU by a measured probe), else float32 (docs/precision.md)
    dtype: str = one_of("float32", *DTYPES)
    trust_remote_code: bool = False  # run the checkpoint folder's own modelling code (transformers and vLLM)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    task: Optional[str] = one_of("sort", *TASK_NAMES)  # a built-in synthetic task, or null to read train_path/eval_path
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
    mode: str = one_of("colocate", "colocate", "hybrid", "split")
    num_gpus: int = 0  # 0 = CPU only (no GPU requests)
    # copies of the reference model, each scoring a share of the rows; null = one beside every trainer rank when
    # colocated on GPUs (no extra GPU), else 1 (under split each copy takes a whole GPU)
    reference_ranks: Optional[int] = None
    # torch threads of each worker process; null = $OMP_NUM_THREADS where set, else this host's cores shared by the
    # workers that compute at the same time (the trainer ranks, or the engines: the phases take turns)
    cpu_threads: Optional[int] = None


@dataclass
class RolloutConfig:
    engine: str = one_of("vllm", *ENGINES)  # hf = transformers generate, for hosts without vLLM
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
    sync_channel: str = one_of("auto", "auto", "broadcast", "ipc")
    # with LoRA and vLLM: adapter (send only the adapter) | merged (full merged weights)
    lora_sync: str = one_of("adapter", "adapter", "merged")
    # warn when mean |rollout - trainer log-prob| exceeds this; null = by model.dtype (LOGPROB_DIFF_WARN)
    logprob_diff_warn: Optional[float] = None
    # asynchronous RL: the engines generate ahead while the trainer trains, a sample's oldest token at most this many
    # updates behind the trained weights (paced: nothing is discarded); 0 = generate, then train (docs/async.md)
    max_staleness: int = 0
    chunk_tokens: int = 32  # max_staleness > 0: samples stay in their engine across syncs, advanced this much a call
    # what they continue on after a sync: keep (their KV so far) | recompute (their context prefilled again)
    inflight_kv: str = one_of("keep", "keep", "recompute")
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
    stage: str = one_of("sft", *STAGES)  # what the run trains: supervised, a reward model, DPO, or RL with rollouts
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


def choices_of(cls: Optional[type] = None, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: allowed values} for every field declared with `one_of`, in declaration order."""
    out = {}
    for f in dataclasses.fields(cls or RunConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out.update(choices_of(type(default), f"{prefix}{f.name}."))
        elif "choices" in f.metadata:
            out[f"{prefix}{f.name}"] = f.metadata["choices"]
    return out


CHOICES = choices_of()  # the keys whose value is one of a fixed set: checked, and listed by --help-config
