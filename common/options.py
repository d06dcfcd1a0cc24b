"""The option objects workers receive (small dataclasses, never the whole run config). `rlhf.config` composes them
into RunConfig, so they are also the `model.lora`, `trainer` and `algorithm` sections of a YAML config. A key whose
value is one of a fixed set declares the set here, once (`one_of`): rlhf.config checks it and lists it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


def one_of(default: Any, *allowed: Any):
    """A dataclass field whose value must be one of `allowed` (null passes where the key is Optional). OmegaConf
    cannot enforce these as Enum types (names like bf16-true and k3+ are not identifiers), so rlhf.config.checks
    does, and --help-config and docs/config-reference.md list them."""
    return field(default=default, metadata={"choices": allowed})


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
    zero_stage: int = one_of(0, 0, 1, 2, 3)
    world_size: int = 1  # data-parallel ranks (stage rl); each is a Ray actor
    max_bad_steps: int = 3  # stop after this many consecutive steps with a NaN/Inf loss or grad norm; 0 = never
    offload: bool = False  # stage rl: DeepSpeed states to CPU while rollout runs (GPU colocation; ZeRO 1-3)
    # micro-batches by padded tokens (rows x longest row) instead of micro_batch_size rows: as many rows as fit,
    # longest first, the same count on every rank (common.packing); null = micro_batch_size rows
    max_tokens_per_micro_batch: Optional[int] = None
    # each micro-batch's rows end to end without padding, position ids restarting per row (common.packing.pack_rows);
    # the same loss. For per-sequence attention (flash attention on GPU); on CPU sdpa's dense mask makes it slower
    # (docs/performance.md). Policy and critic (per-token outputs), not the reward model
    packing: bool = False
    # rows that share a prompt (a group's samples, a DPO pair) go through the model as one row, the prompt computed
    # once, under a 4D attention mask (common.prefix_sharing); the same loss and gradient. sdpa or eager attention
    shared_prefix: bool = False
    attn_implementation: Optional[str] = None  # the trainer's model: sdpa | eager | flash_attention_2 | ...; null: HF
    # log-probs (policy, reference, teacher) from the final hidden states, the LM head applied to the trained
    # positions a chunk at a time (actors.logits.DeferredHead): the (rows, T, V) logits never exist at once. Models
    # whose logits are more than their head's output (final soft-capping) keep the full logits. On by default: as
    # fast as the full logits on short rows, a fraction of their memory on long ones, the same learning over 10 seeds
    # (docs/performance.md)
    chunked_logprobs: bool = True
    # keep only each decoder layer's input for the backward and recompute the layer there (activation
    # checkpointing, non-reentrant): about a third more compute for a fraction of the memory; for long sequences
    gradient_checkpointing: bool = False
    # bf16-true (bf16 weights, fp32 masters from the checkpoint's values) | bf16-mixed (fp32 weights under bf16
    # autocast) | fp32 (common/dtypes.py, docs/configuration.md); null = by model.dtype: float32 -> fp32,
    # bfloat16 -> bf16-true. The engines run in model.dtype whatever this is
    precision: Optional[str] = one_of(None, *PRECISIONS)


@dataclass
class AlgorithmConfig:
    """On-policy RL (stage: rl)."""

    name: str = one_of("grpo", *ALGORITHMS)  # the estimator; opd = on-policy distillation from teacher.path
    kl_coef: float = 0.0  # 0 = no reference model
    kl_estimator: str = one_of("k3", *KL_ESTIMATORS)  # k3+ = k3's value, k2's gradient; see algorithms/kl.py
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
    rollout_correction: str = one_of("token", "token", "sequence")
    # the policy surrogate (algorithms/policy_losses.py): clip (PPO) | gspo | gspo_token (sequence-level ratio,
    # GSPO) | cispo (clipped stop-gradient weight, every token keeps its gradient)
    policy_loss: str = one_of("clip", *POLICY_LOSSES)
    # DAPO's overlong shaping: over the last N tokens of rollout.max_new_tokens the reward falls linearly, by
    # overlong_penalty at the budget (a completion cut there loses it all); 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0  # the reward a completion loses at the end of the budget (DAPO: 1.0)
    # opd: the task reward's GRPO advantage, times this, beside the teacher's per-token signal; 0 = distillation alone
    opd_task_coef: float = 0.0
    loss_agg: str = one_of("token-mean", *LOSS_AGG)  # how token losses become the batch loss (docs/algorithms.md)
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
    dpo_loss: str = one_of("sigmoid", "sigmoid", "ipo", "hinge")  # dpo: the preference loss
    label_smoothing: float = 0.0  # dpo (sigmoid): assumed fraction of flipped labels
    dpo_nll_coef: float = 0.0  # dpo: + coef x per-token NLL of the chosen answer (RPO, Pang et al. 2024)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, refill from new prompts
    # prompts generated per rollout round = oversample x rollout.prompts_per_step; the step trains on the first
    # prompts_per_step groups whose rewards differ (topped up with all-equal ones): informative groups in one round
    oversample: float = 1.0

    def tis_bounds(self) -> Optional[tuple[float, float]]:
        """(tis_mask_low, tis_mask_high), or None when masking is off."""
        return None if self.tis_mask_low is None else (self.tis_mask_low, self.tis_mask_high)


@dataclass
class EnvConfig:
    """Multi-turn rollouts against an environment (rollout.env). `name` unset = single-turn completions."""

    name: Optional[str] = None  # package.module:ClassName, a rollout.env.Environment; one instance per trajectory
    max_turns: int = 4  # model turns per trajectory
    kwargs: dict = field(default_factory=dict)  # passed to the class's constructor
    timeout_s: float = 30.0  # per reset/step; a step over it (or one that raises) ends its trajectory, reward 0
    num_workers: int = 8  # threads stepping environments while the engines generate
    observation_role: str = one_of("user", "user", "tool")  # observations' chat role (tool where the template has one)


@dataclass
class RewardConfig:
    fn: Optional[str] = None  # "package.module:function"; unset = the built-in task's verifiable reward
    model_path: Optional[str] = None  # stage rl: score rollouts with this reward model (an `rm` stage's final/)
    timeout_s: float = 600.0  # seconds one call of reward.fn (a step's completions) may take before the run stops
    # a reward service: POST {"prompts", "completions", "metadata"} -> {"rewards"} (rollout.reward_http)
    url: Optional[str] = None
    url_batch: int = 32  # completions per request
    url_concurrency: int = 4  # requests in flight at once
    url_retries: int = 3  # retries of a request that failed to connect, timed out, or got 429 / 5xx


@dataclass
class AgentConfig:
    """An agent's own code played against the rollout's OpenAI-compatible endpoint (rollout.agent). `fn` unset = no
    agent."""

    fn: Optional[str] = None  # package.module:function, run(row, client) -> reward; sync or async
    tool_parser: str = "hermes"  # vLLM's tool-call parser for the model family (hermes, llama3_json, pythonic, ...)
    max_calls: int = 8  # endpoint calls per episode; one more is answered 400 (max_calls_exceeded)
    timeout_s: float = 120.0  # per episode; an agent still running then ends with reward 0, its later calls 404
    concurrency: int = 32  # episodes running at once
    host: str = "127.0.0.1"  # where the endpoint listens
    port: int = 0  # 0 = a free port
