"""The run's configuration as data: one dataclass a section (the episode's sections in common/schema_episodes.py),
composed into `RunConfig`. Workers receive their own sections (`TrainerConfig`, `AlgorithmConfig`, `LoraConfig`,
...), never the whole config. A key whose value is one of a fixed set declares it with `one_of`; `CHOICES` is read
from those declarations, and rlhf/config/ checks them and lists them (--help-config). Nothing here imports torch,
the engines, the trainers or the user's code."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from common.schema_episodes import AgentConfig, EnvConfig, RewardConfig  # noqa: F401 (sections of RunConfig)
from common.schema_fields import one_of

# bf16-true: bf16 weights train (fp32 master copies in the optimizer, started from the checkpoint's own values);
# bf16-mixed: fp32 weights, matmuls under bf16 autocast (norms, embeddings, the residual stream and gradients
# stay fp32, as TRL and accelerate train); fp32: no reduced precision; fp16-true: as bf16-true in float16
PRECISIONS = ("bf16-true", "bf16-mixed", "fp32", "fp16-true")
ALGORITHMS = ("grpo", "rloo", "reinforce_pp", "ppo", "opd")
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")  # algorithms/kl.py (not imported here: the config loads without torch)
LOSS_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("clip", "gspo", "gspo_token", "cispo")  # algorithms/policy_losses.py's table (a test compares)
_BY_DTYPE = {"float32": "fp32", "bfloat16": "bf16-true", "float16": "fp16-true"}


def precision_of(precision: Optional[str], dtype: str) -> str:
    """trainer.precision, or the one model.dtype implies when it is null."""
    return precision if precision is not None else _BY_DTYPE[dtype]


def cuda_ipc_reaches(mode: str, num_engines: int, world_size: int) -> bool:
    """Engine i shares its GPU with trainer rank i, which feeds it (rollout.sync.ipc.feeding_rank)."""
    return mode == "colocate" and num_engines <= world_size


@dataclass
class LoraConfig:
    """PEFT LoRA on the policy; rank 0 = full fine-tuning. The reference model is then the policy with its
    adapter disabled (no second copy)."""

    rank: int = 0  # the adapter's rank; 0 = no adapter, full fine-tuning
    alpha: int = 16  # LoRA scaling numerator (the update is scaled by alpha / rank)
    dropout: float = 0.0  # dropout on the adapter's input
    # the modules (by name) that get an adapter
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TrainerConfig:
    lr: float = 1e-3  # peak learning rate (AdamW), reached after warmup_steps, then constant
    batch_size: int = 32  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 8  # sequences per forward pass on one rank
    max_steps: int = 100  # optimizer steps of the run (stage rl: one rollout and update each)
    warmup_steps: int = 10  # linear learning-rate warm-up from 0
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this
    # DeepSpeed ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters sharded
    zero_stage: int = one_of(0, 1, 2, 3)
    world_size: int = 1  # trainer ranks (stage rl), each a Ray actor: data-parallel x sequence-parallel
    # Ulysses sequence parallelism: each sequence's tokens split over this many ranks (of world_size; they train the
    # same rows), attention heads exchanged by all-to-all (actors/sequence_parallel.py). For sequences one rank
    # cannot hold; must divide world_size and the model's attention heads
    sequence_parallel_size: int = 1
    max_bad_steps: int = 3  # stop after this many consecutive steps with a NaN/Inf loss or grad norm; 0 = never
    offload: bool = False  # stage rl: DeepSpeed states to CPU while rollout runs (GPU colocation; ZeRO 1-3)
    # micro-batches by padded tokens (rows x longest row) instead of micro_batch_size rows: as many rows as fit,
    # longest first, the same count on every rank (actors/batching/packing.py); null = micro_batch_size rows
    max_tokens_per_micro_batch: Optional[int] = None
    # each micro-batch's rows end to end without padding, position ids restarting per row
    # (actors/batching/packing.py: pack_rows); the same loss. For per-sequence attention (flash attention on GPU); on
    # CPU sdpa's dense mask makes it slower (benchmarks/results/train_phase.md). Policy and critic (per-token outputs),
    # not the reward model
    packing: bool = False
    # rows that share a prompt (a group's samples, a DPO pair) go through the model as one row, the prompt computed
    # once, under a 4D attention mask (actors/batching/prefix_sharing.py); the same loss and gradient. sdpa or eager
    # attention
    shared_prefix: bool = False
    attn_implementation: Optional[str] = None  # the trainer's model: sdpa | eager | flash_attention_2 | ...; null: HF
    # log-probs (policy, reference, teacher) from the final hidden states, the LM head applied to the trained
    # positions a chunk at a time (actors.logits.DeferredHead): the (rows, T, V) logits never exist at once. Models
    # whose logits are more than their head's output (final soft-capping) keep the full logits. On by default: as
    # fast as the full logits on short rows, a fraction of their memory on long ones, the same learning over 10 seeds
    # (benchmarks/results/long_sequences.md)
    chunked_logprobs: bool = True
    # keep only each decoder layer's input for the backward and recompute the layer there (activation
    # checkpointing, non-reentrant): about a third more compute for a fraction of the memory; for long sequences
    gradient_checkpointing: bool = False
    # before each update, estimate what its micro-batches' backward keeps (the model's shape, the rows' lengths)
    # against the memory free now; where they would not fit, take fewer rows a micro-batch (a token budget), and turn
    # gradient checkpointing on where even one row would not fit; said once in the log (actors/memory_plan.py)
    plan_memory: bool = True
    # what a trainer rank's process may hold at its step's peak, in GiB, for plan_memory (a node shared with the
    # engines, other models or other jobs); null: what is free (the GPU's; on CPU the node's available memory shared
    # by the trainer ranks on it)
    memory_limit_gb: Optional[float] = None
    # a mixture of experts: the weight of the routers' load-balancing loss (Switch Transformer, as transformers
    # computes it) added to the training loss; null: the model config's router_aux_loss_coef where the config sets
    # output_router_logits (transformers' own training), else 0. Logged either way (train/router_aux_loss)
    router_aux_loss_coef: Optional[float] = None
    # bf16-true (bf16 weights, fp32 masters from the checkpoint's values) | bf16-mixed (fp32 weights under bf16
    # autocast) | fp32 (common/dtypes.py, docs/configuration.md); null = by model.dtype: float32 -> fp32,
    # bfloat16 -> bf16-true. The engines run in model.dtype whatever this is
    precision: Optional[str] = one_of(*PRECISIONS, default=None)


@dataclass
class AlgorithmConfig:
    """On-policy RL (stage: rl)."""

    name: str = one_of(*ALGORITHMS)  # the estimator; opd = on-policy distillation from teacher.path
    kl_coef: float = 0.0  # 0 = no reference model
    kl_estimator: str = one_of(*KL_ESTIMATORS, default="k3")  # k3+ = k3's value, k2's gradient; see algorithms/kl.py
    kl_in_reward: bool = False  # true: -kl_coef*KL added to token rewards; false: kl_coef*KL added to the loss
    clip_low: float = 0.2  # PPO ratio clip below 1: ratio >= 1 - clip_low
    clip_high: float = 0.2  # PPO ratio clip above 1: ratio <= 1 + clip_high (DAPO raises it, e.g. 0.28)
    # dual-clip PPO: the loss of a negative-advantage token is bounded at this ratio (e.g. 3); null = off
    dual_clip: Optional[float] = None
    # truncated importance sampling: each token's loss weighted by min(pi_old / pi_rollout, tis_cap), for the
    # rollout/trainer mismatch and for samples of older weights; null = off (2.0 under rollout.max_staleness > 0)
    tis_cap: Optional[float] = None
    # IcePop's masking: a token whose pi_old / pi_rollout is below tis_mask_low or above tis_mask_high is left out of
    # the loss; null = off (0.5 and 5.0 under rollout.max_staleness > 0)
    tis_mask_low: Optional[float] = None
    tis_mask_high: Optional[float] = None  # the mask's upper bound (see tis_mask_low)
    # what tis_cap (truncate) and tis_mask_* (mask) weigh: token (each token's pi_old / pi_rollout) | sequence (one
    # weight per response, the product of its tokens' ratios); the engine-trainer mismatch correction's level
    rollout_correction: str = one_of("token", "sequence")
    # an MoE (docs/moe.md): rollout = the trainer routes as the engine did (R3), measure = moe/router_agreement only
    routing_replay: str = one_of("off", "measure", "rollout")
    # the policy surrogate (algorithms/policy_losses.py): clip (PPO) | gspo | gspo_token (sequence-level ratio,
    # GSPO) | cispo (clipped stop-gradient weight, every token keeps its gradient)
    policy_loss: str = one_of(*POLICY_LOSSES)
    # DAPO's overlong shaping: over the last N tokens of rollout.max_new_tokens the reward falls linearly, by
    # overlong_penalty at the budget (a completion cut there loses it all); 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the reward a completion loses at the end of the budget (DAPO: 1.0)
    # opd: the task reward's GRPO advantage, times this, beside the teacher's per-token signal; 0 = distillation alone
    opd_task_coef: float = 0.0
    loss_agg: str = one_of(*LOSS_AGG)  # how token losses become the batch loss (docs/algorithms.md)
    # seq-mean-token-sum-norm's constant (Dr. GRPO divides each sequence's token sum by the generation budget);
    # null = rollout.max_new_tokens
    loss_norm_len: Optional[int] = None
    ppo_epochs: int = 1  # passes over each rollout; more than 1 reshuffles the rows into new mini-batches
    scale_by_std: bool = True  # grpo; false = Dr. GRPO
    gamma: float = 1.0  # ppo (GAE) and reinforce_pp discount
    lam: float = 0.95  # ppo: GAE lambda
    critic_lr: float = 1e-4  # ppo: the critic's learning rate (other trainer settings are shared)
    value_clip: float = 0.2  # ppo: clip range of the value loss
    beta: float = 0.1  # dpo: strength of the implicit KL constraint
    dpo_loss: str = one_of("sigmoid", "ipo", "hinge")  # dpo: the preference loss
    label_smoothing: float = 0.0  # dpo (sigmoid): assumed fraction of flipped labels
    dpo_nll_coef: float = 0.0  # dpo: + coef x per-token NLL of the chosen answer (RPO, Pang et al. 2024)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, refill from new prompts
    # prompts generated per rollout round = oversample x rollout.prompts_per_step; the step trains on the first
    # prompts_per_step groups whose rewards differ (topped up with all-equal ones): informative groups in one round
    oversample: float = 1.0

    def tis_bounds(self) -> Optional[tuple[float, float]]:
        """(tis_mask_low, tis_mask_high), or None when masking is off."""
        return None if self.tis_mask_low is None else (self.tis_mask_low, self.tis_mask_high)

    def kl_mode(self) -> str:
        """Where the KL to the reference goes: "off" (kl_coef 0: no reference model at all), "reward" (a per-token
        penalty in the rewards, estimated on the driver) or "loss" (a loss term, estimated by the update)."""
        if self.kl_coef == 0:
            return "off"
        return "reward" if self.kl_in_reward else "loss"


STAGES = ("sft", "rl", "dpo", "rm")
TASK_NAMES = ("sort", "add", "guess")  # rlhf/stages/tasks.py's TASKS (a test compares)
REWARD_NAMES = ("sort", "add", "math", "guess")  # rollout/rewards/__init__.py's BUILTIN (a test compares)
ENGINES = ("vllm", "hf")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ARCHS = ("qwen2", "llama", "qwen3_moe")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
# Engine and trainer kernels round differently: ~1e-6 apart in fp32, ~1e-2 in 16-bit types. A stale weight or
# prefix cache shows up as 1e-1 and more.
LOGPROB_DIFF_WARN = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # what vLLM's attention kernels support


@dataclass
class TinyModelConfig:
    """A randomly initialised model built locally when `model.path` is unset (nothing can be downloaded)."""

    arch: str = one_of(*ARCHS)  # the transformers architecture the tiny model is built as
    hidden_size: int = 128  # its width; hidden_size / num_heads must be a head size vLLM supports
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention); divides num_heads
    intermediate_size: int = 256  # MLP width
    max_position_embeddings: int = 256  # the longest sequence it can take
    num_experts: int = 4  # qwen3_moe: experts in each layer's MLP (intermediate_size wide each)
    experts_per_token: int = 2  # qwen3_moe: the experts each token is routed to (top-k)


@dataclass
class ModelConfig:
    path: Optional[str] = None  # a local Hugging Face folder; unset = build the tiny model into <output_dir>
    # the weights' dtype in the trainers (DeepSpeed: fp32 master weights under bfloat16) and the engines; auto =
    # bfloat16 where the device runs it fast (CUDA 8.0+; a CPU by a measured probe), else float32 (docs/precision.md)
    dtype: str = one_of(*DTYPES, default="float32")
    trust_remote_code: bool = False  # run the checkpoint folder's own modelling code (transformers and vLLM)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    task: Optional[str] = one_of(*TASK_NAMES)  # a built-in synthetic task, or null to read train_path/eval_path
    train_path: Optional[str] = None  # JSONL, Parquet, or a `datasets` folder saved with save_to_disk
    eval_path: Optional[str] = None  # held-out rows, the same format; evaluation uses them
    prompt_key: str = "prompt"  # a string, or a list of {role, content} messages; dotted keys reach nested columns
    answer_key: str = "answer"  # optional for RL prompts: reward functions receive it as `answer` when present
    messages_key: str = "messages"  # SFT data as whole conversations (loss on assistant turns), when no prompt
    apply_chat_template: bool = False  # wrap string prompts as one user message in the checkpoint's chat template
    # a chat template for a checkpoint without one (a base model): gemma, chatml or a Jinja file; saved with the
    # tokenizer into every model folder the run writes (rollout/render/chat_templates.py)
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
    mode: str = one_of("colocate", "hybrid", "split")
    num_gpus: int = 0  # 0 = CPU only (no GPU requests)
    # copies of the reference model, each scoring a share of the rows; null = one beside every trainer rank when
    # colocated on GPUs (no extra GPU), else 1 (under split each copy takes a whole GPU)
    reference_ranks: Optional[int] = None
    # torch threads of each worker process; null = $OMP_NUM_THREADS where set, else this host's cores shared by the
    # workers that compute at the same time (the trainer ranks, or the engines: the phases take turns)
    cpu_threads: Optional[int] = None


@dataclass
class RolloutConfig:
    engine: str = one_of(*ENGINES)  # hf = transformers generate, for hosts without vLLM
    num_engines: int = 1  # rollout engines, each a Ray actor (data parallel: prompts are split across them)
    # vLLM tensor parallelism: each engine's weights split over this many workers (vLLM's multiprocess executor; on
    # CPU one core each, docs/configuration.md); for models one device cannot hold. Divides the attention heads
    tensor_parallel_size: int = 1
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
    sync_channel: str = one_of("auto", "broadcast", "ipc")
    # with LoRA and vLLM: adapter (send only the adapter) | merged (full merged weights)
    lora_sync: str = one_of("adapter", "merged")
    # warn when mean |rollout - trainer log-prob| exceeds this; null = by model.dtype (LOGPROB_DIFF_WARN)
    logprob_diff_warn: Optional[float] = None
    router_agreement_warn: float = 0.9  # warn when moe/router_agreement (algorithm.routing_replay on) is below
    # asynchronous RL: the engines generate ahead while the trainer trains, a sample's oldest token at most this many
    # updates behind the trained weights (paced: nothing is discarded); 0 = generate, then train (docs/async.md)
    max_staleness: int = 0
    chunk_tokens: int = 32  # max_staleness > 0: samples stay in their engine across syncs, advanced this much a call
    # what they continue on after a sync: keep (their KV so far) | recompute (their context prefilled again)
    inflight_kv: str = one_of("keep", "recompute")
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
    # every actor's calls, what it did inside them, and the driver's phases as spans in <output_dir>/trace.json
    # (ui.perfetto.dev opens it), and each step's util/... and perf/..._mfu metrics (docs/performance.md: where the
    # time goes)
    trace: bool = True


@dataclass
class CostConfig:
    """What the run's device time costs (docs/performance.md: where the time goes)."""

    # the price of one device-hour (a GPU's; on CPU a worker process's), any currency: the run's end then says what
    # its steps cost and its evaluation gain per unit spent; null = device-hours only
    price_per_device_hour: Optional[float] = None


@dataclass
class RunConfig:
    stage: str = one_of(*STAGES)  # what the run trains: supervised, a reward model, DPO, or RL with rollouts
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
    agent: AgentConfig = field(default_factory=AgentConfig)  # stage rl: agents through an endpoint (rollout/agents/)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: CostConfig = field(default_factory=CostConfig)


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
