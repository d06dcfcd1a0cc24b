"""The RL stage's checks (part of rlhf.config.checks.validate): the rollout settings, the objective (estimator
group sizes, the policy loss, KL, off-policy corrections, overlong shaping), asynchronous RL, the environment and
the agent, and the weight-sync channel against the placement."""
from __future__ import annotations

from common.schema import cuda_ipc_reaches
from common.schema import RunConfig
from rlhf.config.problems import Problems


def check_rl(cfg: RunConfig, p: Problems) -> None:
    a, r = cfg.algorithm, cfg.rollout
    if a.oversample < 1:
        p.bad("algorithm.oversample", a.oversample, "must be >= 1 (prompts generated per round / prompts_per_step)")
    p.positives("algorithm", a, ("clip_low", "clip_high", "ppo_epochs"))
    p.positives("rollout", r, ("num_engines", "prompts_per_step", "n_samples", "max_new_tokens", "sync_bucket_mb",
                               "chunk_tokens", "tensor_parallel_size"))
    if r.timeout_s is not None:
        p.positive("rollout.timeout_s", r.timeout_s)
    if r.verify_sync_every < 0:
        p.bad("rollout.verify_sync_every", r.verify_sync_every, "must be >= 0 (0 = off, N = every N-th sync)")
    if r.max_engine_restarts < 0:
        p.bad("rollout.max_engine_restarts", r.max_engine_restarts, "must be >= 0 (0: a dead engine ends the run)")
    if r.logprob_diff_warn is not None and r.logprob_diff_warn <= 0:
        p.bad("rollout.logprob_diff_warn", r.logprob_diff_warn, "must be > 0, or null for the dtype's default")
    if not 0 <= r.router_agreement_warn <= 1:
        p.bad("rollout.router_agreement_warn", r.router_agreement_warn, "must be in [0, 1] (0 = never warn)")
    if r.temperature < 0 or not 0 < r.top_p <= 1:
        p.bad("rollout.temperature/top_p", (r.temperature, r.top_p), "need temperature >= 0 and 0 < top_p <= 1")
    rollout_batch = r.prompts_per_step * r.n_samples
    if cfg.trainer.batch_size > 0 and rollout_batch % cfg.trainer.batch_size:
        p.bad("trainer.batch_size", cfg.trainer.batch_size, f"must divide the rollout batch rollout.prompts_per_step "
              f"x rollout.n_samples = {rollout_batch}; it is the mini-batch of each optimizer step")
    for part in (check_objective, check_corrections, check_async, check_env, check_agent, check_sync,
                 check_tensor_parallel, check_routing_replay):
        part(cfg, p)


def check_objective(cfg: RunConfig, p: Problems) -> None:
    a, r = cfg.algorithm, cfg.rollout
    if a.kl_coef < 0:
        p.bad("algorithm.kl_coef", a.kl_coef, "must be >= 0 (0 disables the KL penalty and the reference model)")
    if a.loss_norm_len is not None and a.loss_norm_len <= 0:
        p.bad("algorithm.loss_norm_len", a.loss_norm_len, "must be > 0 (seq-mean-token-sum-norm's constant), or "
              "null for rollout.max_new_tokens")
    if not 0 <= a.overlong_buffer < r.max_new_tokens:
        p.bad("algorithm.overlong_buffer", a.overlong_buffer, f"must be >= 0 (0 = off) and below "
              f"rollout.max_new_tokens = {r.max_new_tokens}: the penalty ramps over the last overlong_buffer tokens "
              "of the budget")
    if a.overlong_buffer and (cfg.env.name is not None or cfg.agent.fn is not None):
        p.bad("algorithm.overlong_buffer", a.overlong_buffer, "shapes single-turn completions against "
              "rollout.max_new_tokens; a multi-turn trajectory has a budget per turn: set it to 0 with env.name or "
              "agent.fn")
    if a.overlong_penalty < 0:
        p.bad("algorithm.overlong_penalty", a.overlong_penalty, "must be >= 0 (the reward lost at the budget's end)")
    if (a.name == "opd") != (cfg.teacher.path is not None):
        p.bad("teacher.path", cfg.teacher.path, "algorithm.name=opd distils from a teacher: set teacher.path to its "
              "HF folder; other algorithms have none (set it to null)")
    if a.name == "opd" and a.opd_task_coef and r.n_samples < 2:
        p.bad("rollout.n_samples", r.n_samples, "algorithm.opd_task_coef compares samples of the same prompt: use "
              ">= 2")
    from algorithms.estimators import ESTIMATORS  # the math, not the engines: group sizes live with the estimators
    least = ESTIMATORS[a.name].min_group_size if a.name in ESTIMATORS else 1
    if r.n_samples < least:
        p.bad("rollout.n_samples", r.n_samples, f"{a.name} compares samples of the same prompt (with fewer than "
              f"{least} every advantage is 0): use >= {least}")


def check_corrections(cfg: RunConfig, p: Problems) -> None:
    """Dual clip and the off-policy corrections (truncated importance sampling, IcePop's mask)."""
    a = cfg.algorithm
    if a.dual_clip is not None and a.dual_clip <= 1:
        p.bad("algorithm.dual_clip", a.dual_clip, "must be > 1 (e.g. 3.0), or null to disable")
    if a.dual_clip is not None and a.policy_loss != "clip":
        p.bad("algorithm.dual_clip", a.dual_clip, f"bounds the clip surrogate's loss; with algorithm.policy_loss="
              f"{a.policy_loss} set it to null")
    if a.tis_cap is not None and a.tis_cap <= 0:
        p.bad("algorithm.tis_cap", a.tis_cap, "must be > 0 (e.g. 2.0), or null to disable")
    bounds = (a.tis_mask_low, a.tis_mask_high)
    if (bounds[0] is None) != (bounds[1] is None) or (bounds[0] is not None and not 0 < bounds[0] <= 1 <= bounds[1]):
        p.bad("algorithm.tis_mask_low/tis_mask_high", bounds, "set both (0 < low <= 1 <= high, e.g. 0.5 and 5.0), "
              "or neither")


def check_async(cfg: RunConfig, p: Problems) -> None:
    """rollout.max_staleness > 0: what can run ahead of the trainer (docs/async.md)."""
    r = cfg.rollout
    if r.max_staleness < 0:
        p.bad("rollout.max_staleness", r.max_staleness, "must be >= 0 (0 = synchronous; K = samples at most K "
              "updates behind the trained weights)")
    if r.max_staleness > 0 and cfg.placement.num_gpus > 0 and cfg.placement.mode == "colocate":
        p.bad("rollout.max_staleness", r.max_staleness, "colocated roles take turns on the GPUs (the engines sleep "
              "while the trainers train), so nothing can run ahead: use placement.mode=split, or max_staleness=0")


def check_env(cfg: RunConfig, p: Problems) -> None:
    """env.* (whether env.name imports and builds is checked at start-up: rlhf.rl.preflight)."""
    if cfg.env.name is None:
        return
    p.positives("env", cfg.env, ("max_turns", "timeout_s", "num_workers"))
    if cfg.reward.model_path is not None:
        p.bad("reward.model_path", cfg.reward.model_path, "with env.name the environment gives the rewards; unset "
              "one")


def check_agent(cfg: RunConfig, p: Problems) -> None:
    """agent.*: the user's agent through the rollout's endpoint (docs/agents.md); its code and tool parser are
    checked at start-up (rlhf.rl.preflight)."""
    g = cfg.agent
    if g.fn is None:
        return
    p.positives("agent", g, ("max_calls", "timeout_s", "concurrency"))
    if cfg.env.name is not None:
        p.bad("agent.fn", g.fn, "an agent and an environment (env.name) both play the episodes: set one")
    for key in ("fn", "model_path", "url"):
        if getattr(cfg.reward, key) is not None:
            p.bad(f"reward.{key}", getattr(cfg.reward, key), "with agent.fn the agent returns each episode's "
                  "reward; unset it")


def check_sync(cfg: RunConfig, p: Problems) -> None:
    """The weight-sync channel against the placement (what NCCL and CUDA IPC can and cannot do)."""
    r, pl, world = cfg.rollout, cfg.placement, cfg.trainer.world_size
    if pl.mode == "hybrid":
        check_hybrid(cfg, p)
        return
    if r.sync_channel == "ipc" and pl.num_gpus > 0 and not cuda_ipc_reaches(pl.mode, r.num_engines, world):
        p.bad("rollout.sync_channel", r.sync_channel, "CUDA IPC needs every engine on a trainer rank's GPU: use "
              "placement.mode=colocate with rollout.num_engines <= trainer.world_size, or sync_channel=broadcast")
    adapter_sync = cfg.model.lora.rank > 0 and r.engine == "vllm" and r.lora_sync == "adapter"
    if not adapter_sync and pl.num_gpus > 0 and pl.mode == "colocate" and (r.sync_channel == "broadcast" or (
            r.sync_channel == "auto" and not cuda_ipc_reaches(pl.mode, r.num_engines, world))):
        p.bad("rollout.sync_channel", r.sync_channel, "would broadcast over NCCL, which refuses two ranks on one GPU "
              "(colocated, engine 0 shares GPU 0 with trainer rank 0): use sync_channel=auto/ipc with "
              f"rollout.num_engines <= trainer.world_size = {world} (CUDA IPC), or placement.mode=split")
    if cfg.model.lora.rank > 512 and adapter_sync:
        p.bad("model.lora.rank", cfg.model.lora.rank, "vLLM applies adapters up to rank 512; lower it or set "
              "rollout.lora_sync=merged")
    if cfg.trainer.offload and pl.mode == "split" and pl.num_gpus > 0:
        p.bad("trainer.offload", True, "under placement.mode=split nothing shares the trainer's GPUs, so moving its "
              "states to the CPU and back each step only costs time: set trainer.offload=false (offloading is for "
              "colocate and hybrid)")


def check_tensor_parallel(cfg: RunConfig, p: Problems) -> None:
    """rollout.tensor_parallel_size: vLLM's own workers in processes of the engine's; on GPUs they need whole GPUs
    of the engine's own (placement.mode=split). The model's heads are checked before the workers start."""
    r, pl = cfg.rollout, cfg.placement
    if r.tensor_parallel_size <= 1:
        return
    if r.engine != "vllm":
        p.bad("rollout.tensor_parallel_size", r.tensor_parallel_size, "splits a vLLM engine; the hf engine holds "
              "whole models: set rollout.engine=vllm, or tensor_parallel_size=1")
    elif pl.mode == "hybrid" or (pl.num_gpus > 0 and pl.mode != "split"):
        p.bad("rollout.tensor_parallel_size", r.tensor_parallel_size, f"an engine's tensor-parallel workers take "
              f"GPUs of their own, and placement.mode={pl.mode} shares one GPU a rank between roles: set "
              "placement.mode=split (rollout.num_engines x tensor_parallel_size GPUs for the engines)")


def check_hybrid(cfg: RunConfig, p: Problems) -> None:
    """`placement.mode: hybrid`: one engine inside each trainer rank, its engine core in the same process, synced
    by reference; the rank does one thing at a time."""
    r, world = cfg.rollout, cfg.trainer.world_size
    if r.num_engines != world:
        p.bad("rollout.num_engines", r.num_engines, f"placement.mode=hybrid puts one engine in each trainer rank: "
              f"set rollout.num_engines={world} (trainer.world_size), or placement.mode=colocate")
    if r.sync_channel != "auto":
        p.bad("rollout.sync_channel", r.sync_channel, "placement.mode=hybrid hands the weights to the engine in the "
              "same process: set rollout.sync_channel=auto, or placement.mode=colocate")
    if r.multiprocess:
        p.bad("rollout.multiprocess", True, "placement.mode=hybrid keeps the engine core in the trainer's process "
              "(the sync passes tensors by reference): set rollout.multiprocess=null, or placement.mode=colocate")
    if r.max_staleness > 0:
        p.bad("rollout.max_staleness", r.max_staleness, "placement.mode=hybrid generates and trains in one process, "
              "one after the other, so nothing can run ahead: set rollout.max_staleness=0, or "
              "placement.mode=colocate/split")


def check_routing_replay(cfg: RunConfig, p: Problems) -> None:
    """algorithm.routing_replay: routes come from vLLM's workers for samples and multi-turn trajectories (generated
    in a step or ahead of it), and replay needs the trainer's forward to see the rows as the rollout laid them out."""
    tr, r, mode = cfg.trainer, cfg.rollout, cfg.algorithm.routing_replay
    if mode == "off":
        return
    refused = (("rollout.engine", r.engine, r.engine != "vllm", "the transformers engine records no routes: use vllm"),
               ("agent.fn", cfg.agent.fn, cfg.agent.fn is not None, "agent trajectories do not carry routes yet"),
               ("trainer.packing", tr.packing, tr.packing,
                "a packed forward lays the tokens out anew: set it to false"),
               ("trainer.shared_prefix", tr.shared_prefix, tr.shared_prefix,
                "a shared-prefix forward computes a prompt once for all its rows: set it to false"),
               ("trainer.sequence_parallel_size", tr.sequence_parallel_size, tr.sequence_parallel_size > 1,
                "each rank sees a slice of a row's tokens: use 1"))
    for key, value, bad, why in refused:
        if bad:
            p.bad(key, value, f"algorithm.routing_replay={mode}: {why} (or set algorithm.routing_replay: off)")
