"""What the config alone can say is wrong: every problem at once, each as 'dotted.key = value: what is wrong. how to
fix it', collected in one `Problems`. The RL stage's checks are in checks_rl.py; what needs the host or the user's
code (env.name, agent.fn, the installed vLLM and DeepSpeed) is checked when the run starts (rlhf.rl.preflight)."""
from __future__ import annotations

import dataclasses
from typing import Any

from common.schema import ATTN_IMPLEMENTATIONS, REWARD_NAMES, TASK_NAMES, VLLM_HEAD_DIMS, RunConfig
from rlhf.config.checks_rl import check_rl
from rlhf.config.problems import Problems


def validate(cfg: RunConfig) -> list[str]:
    """Every problem of `cfg` the config alone shows; [] when there is none."""
    p = Problems()
    check_choices(cfg, p)
    for part in (check_model, check_trainer, check_outputs, check_data):
        part(cfg, p)
    if cfg.stage == "rl":
        check_rl(cfg, p)
    if cfg.stage in ("dpo", "rm"):
        check_preference(cfg, p)
    return p.found


def check_choices(obj: Any, p: Problems, prefix: str = "") -> None:
    """Each key declared with `one_of` (common.schema) holds one of its values; null passes (Optional keys)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_choices(value, p, f"{prefix}{f.name}.")
        elif "choices" in f.metadata and value is not None:
            p.choice(f"{prefix}{f.name}", value, f.metadata["choices"])


def check_tiny_experts(t, p: Problems) -> None:
    p.positives("model.tiny", t, ("num_experts", "experts_per_token"))
    if t.experts_per_token > t.num_experts:
        p.bad("model.tiny.experts_per_token", t.experts_per_token,
              f"routes each token to more experts than model.tiny.num_experts={t.num_experts}; lower it")
    if t.intermediate_size % 32:
        p.bad("model.tiny.intermediate_size", t.intermediate_size, "must be a multiple of 32 for a mixture of "
              "experts: vLLM's CPU expert kernel pads other widths, and a padded layer cannot take a weight sync")


def check_model(cfg: RunConfig, p: Problems) -> None:
    t = cfg.model.tiny
    p.positives("model.tiny", t, ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                                  "max_position_embeddings"))
    if t.num_heads > 0 and t.hidden_size % t.num_heads:
        p.bad("model.tiny.hidden_size", t.hidden_size, f"must be divisible by model.tiny.num_heads={t.num_heads}")
    elif t.num_heads > 0 and t.hidden_size // t.num_heads not in VLLM_HEAD_DIMS:
        p.bad("model.tiny.hidden_size", t.hidden_size, f"gives head size {t.hidden_size // t.num_heads} "
              f"(hidden_size / num_heads), which vLLM cannot run; choose one of {VLLM_HEAD_DIMS}")
    if t.num_kv_heads > 0 and t.num_heads % t.num_kv_heads:
        p.bad("model.tiny.num_heads", t.num_heads, f"must be divisible by model.tiny.num_kv_heads={t.num_kv_heads}")
    if t.arch == "qwen3_moe":
        check_tiny_experts(t, p)
    lora = cfg.model.lora
    if lora.rank < 0 or lora.alpha <= 0 or not 0 <= lora.dropout < 1 or (lora.rank and not lora.target_modules):
        p.bad("model.lora", f"rank={lora.rank} alpha={lora.alpha} dropout={lora.dropout}",
              "need rank >= 0 (0 = off), alpha > 0, 0 <= dropout < 1 and at least one target module")
    if lora.rank > 0 and cfg.stage in ("rm", "dpo"):
        p.bad("model.lora.rank", lora.rank, f"the {cfg.stage} stage trains full weights; set it to 0")


def check_trainer(cfg: RunConfig, p: Problems) -> None:
    tr = cfg.trainer
    p.positives("trainer", tr, ("lr", "batch_size", "micro_batch_size", "max_steps", "grad_clip", "world_size",
                                "sequence_parallel_size"))
    check_sequence_parallel(cfg, p)
    if tr.warmup_steps < 0 or tr.weight_decay < 0 or tr.max_bad_steps < 0:
        p.bad("trainer.warmup_steps/weight_decay/max_bad_steps", (tr.warmup_steps, tr.weight_decay,
                                                                  tr.max_bad_steps), "must be >= 0")
    if cfg.placement.cpu_threads is not None:
        p.positive("placement.cpu_threads", cfg.placement.cpu_threads)
    if tr.router_aux_loss_coef is not None and tr.router_aux_loss_coef < 0:
        p.bad("trainer.router_aux_loss_coef", tr.router_aux_loss_coef, "must be >= 0 (0 = off)")
    if tr.memory_limit_gb is not None:
        p.positive("trainer.memory_limit_gb", tr.memory_limit_gb)
    if tr.max_tokens_per_micro_batch is not None:
        p.positive("trainer.max_tokens_per_micro_batch", tr.max_tokens_per_micro_batch)
    if tr.packing and cfg.stage == "rm":
        p.bad("trainer.packing", True, "the reward model scores each row's last token, so its rows stay padded; "
              "set it to false (packing applies to the sft, dpo and rl stages)")
    if tr.shared_prefix and (tr.packing or cfg.stage == "rm" or tr.attn_implementation not in (None, "sdpa", "eager")):
        p.bad("trainer.shared_prefix", True, "needs trainer.packing: false, a per-token model (not the rm stage) and "
              "sdpa or eager attention (its 4D mask); set it to false or change those")
    if tr.attn_implementation is not None and "/" not in tr.attn_implementation:  # a/b: a kernel from the Hub
        p.choice("trainer.attn_implementation", tr.attn_implementation, ATTN_IMPLEMENTATIONS)
    dp = tr.world_size // tr.sequence_parallel_size if tr.sequence_parallel_size > 0 else tr.world_size
    if tr.micro_batch_size > 0 and dp > 0 and tr.batch_size % (tr.micro_batch_size * dp):
        p.bad("trainer.batch_size", tr.batch_size, f"must be a multiple of trainer.micro_batch_size x the "
              f"data-parallel ranks (trainer.world_size / sequence_parallel_size) = {tr.micro_batch_size * dp}")
    if cfg.stage != "rl" and tr.world_size != 1:
        p.bad("trainer.world_size", tr.world_size, f"the {cfg.stage} stage trains in one process; set it to 1")
    if cfg.placement.num_gpus < 0:
        p.bad("placement.num_gpus", cfg.placement.num_gpus, "must be >= 0 (0 = CPU only)")
    if tr.offload and (tr.zero_stage == 0 or cfg.stage != "rl"):
        p.bad("trainer.offload", True, "moves DeepSpeed's ZeRO states between the phases of stage rl: set "
              "trainer.zero_stage to 1, 2 or 3 (and stage: rl), or offload=false")
    if tr.precision == "bf16-mixed" and tr.zero_stage == 3 and cfg.model.lora.rank == 0:
        p.bad("trainer.precision", "bf16-mixed", "under ZeRO-3 autocast keeps a bf16 copy of every gathered weight "
              "until the forward ends (a whole bf16 model per rank): set trainer.precision=bf16-true, or "
              "zero_stage 1-2")
    if tr.offload and tr.zero_stage == 3 and cfg.placement.num_gpus == 0:
        p.bad("trainer.offload", True, "ZeRO-3 offloads only with DeepSpeed's FusedAdam, a GPU op; on CPU there is "
              "nothing to free anyway: set offload=false (or zero_stage 1-2)")


def check_sequence_parallel(cfg: RunConfig, p: Problems) -> None:
    """What splitting sequences (actors/sequence_parallel.py) cannot compose with; the model's heads are checked
    against the size before the workers start (rlhf/rl/preflight.py)."""
    tr = cfg.trainer
    if tr.sequence_parallel_size <= 1:
        return
    if cfg.stage != "rl":
        p.bad("trainer.sequence_parallel_size", tr.sequence_parallel_size, f"the {cfg.stage} stage trains in one "
              "process; sequences are split over the ranks of stage rl (set it to 1)")
    elif tr.world_size % tr.sequence_parallel_size:
        p.bad("trainer.sequence_parallel_size", tr.sequence_parallel_size, f"must divide trainer.world_size = "
              f"{tr.world_size} (each group of that many ranks trains the same rows)")
    for key, why in (("packing", "restarting position ids inside a row"),
                     ("shared_prefix", "a 4D attention mask")):
        if getattr(tr, key):
            p.bad(f"trainer.{key}", True, f"needs {why}, and a split sequence attends causally without a mask; set "
                  f"it to false, or trainer.sequence_parallel_size=1")
    if tr.attn_implementation == "eager":
        p.bad("trainer.attn_implementation", "eager", "keeps a (T, T) mask per row, which a split sequence does not "
              "carry; use sdpa (or a flash kernel on GPU) with trainer.sequence_parallel_size > 1")


def check_preference(cfg: RunConfig, p: Problems) -> None:
    a = cfg.algorithm
    if cfg.stage == "dpo":
        p.positive("algorithm.beta", a.beta)
        if not 0 <= a.label_smoothing < 0.5:
            p.bad("algorithm.label_smoothing", a.label_smoothing, "must be in [0, 0.5)")
        if a.label_smoothing and a.dpo_loss != "sigmoid":
            p.bad("algorithm.label_smoothing", a.label_smoothing, "applies to dpo_loss=sigmoid only (ipo and hinge "
                  "have no label noise term); set it to 0 or dpo_loss=sigmoid")
    if cfg.trainer.micro_batch_size % 2:
        p.bad("trainer.micro_batch_size", cfg.trainer.micro_batch_size, "counts sequences and must be even for "
              "preference pairs (chosen and rejected stay in the same micro-batch)")


def check_outputs(cfg: RunConfig, p: Problems) -> None:
    """The reward function's name, evaluation, logging and checkpoint settings."""
    fn, url = cfg.reward.fn, cfg.reward.url
    if fn is not None and fn not in REWARD_NAMES and (fn.count(":") != 1 or not all(fn.split(":"))):
        p.bad("reward.fn", fn, f"write it as 'package.module:function', or name a built-in reward: "
              f"{', '.join(REWARD_NAMES)}")
    if url is not None and (not url.startswith(("http://", "https://")) or fn is not None):
        p.bad("reward.url", url, "must be an http:// or https:// address of a reward service, and reward.fn unset")
    p.positives("reward", cfg.reward, ("url_batch", "url_concurrency"))
    e, log = cfg.eval, cfg.logging
    if cfg.run.price_per_device_hour is not None and cfg.run.price_per_device_hour < 0:
        p.bad("run.price_per_device_hour", cfg.run.price_per_device_hour, "must be >= 0, or null (no cost said)")
    if e.every < -1:
        p.bad("eval.every", e.every, "must be >= -1 (0 evaluates only before and after training, -1 never)")
    p.positives("eval", e, ("max_new_tokens", "n_samples"))
    if e.n_samples > 1 and e.temperature <= 0:
        p.bad("eval.temperature", e.temperature, "must be > 0 when eval.n_samples > 1 (greedy samples are all the "
              "same); the greedy pass runs anyway")
    p.positive("logging.console_every", log.console_every)
    if log.rollouts_every < 0 or log.rollouts_per_step < 1:
        p.bad("logging.rollouts_every/rollouts_per_step", (log.rollouts_every, log.rollouts_per_step),
              "need rollouts_every >= 0 (0 = no dumps) and rollouts_per_step >= 1")
    p.positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    if cfg.checkpoint.every < 0:
        p.bad("checkpoint.every", cfg.checkpoint.every, "must be >= 0 (0 = only at the end)")
    gmu = cfg.rollout.gpu_memory_utilization
    if gmu is not None and not 0 < gmu <= 1:
        p.bad("rollout.gpu_memory_utilization", gmu, "is a share of each GPU: set it in (0, 1], or null (0.5 beside "
              "a trainer, 0.9 on a GPU of its own)")


def check_data(cfg: RunConfig, p: Problems) -> None:
    d = cfg.data
    if d.task is None:
        if d.train_path is None:
            p.bad("data.train_path", None, "set it to a JSONL/Parquet file or datasets folder, or set data.task "
                  f"to one of {', '.join(TASK_NAMES)}")
        return
    p.positives("data", d, ("num_train", "num_eval", "min_items", "max_value"))
    if d.max_items < d.min_items:
        p.bad("data.max_items", d.max_items, f"must be >= data.min_items={d.min_items}")
