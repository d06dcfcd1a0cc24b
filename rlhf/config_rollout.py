"""The RL stage's checks that concern rollouts: the environment (env.*) and the weight-sync channel against the
placement. Part of rlhf.config.validate(); `bad(key, value, fix)` records one problem."""
from __future__ import annotations

from typing import TYPE_CHECKING

from common.errors import UserError

if TYPE_CHECKING:
    from rlhf.config import RunConfig


def validate_env(cfg: RunConfig, bad, choice, positive) -> None:
    e = cfg.env
    validate_agent(cfg, bad, positive)
    if e.name is None:
        return
    from rollout.env import load_environment
    try:
        cls = load_environment(e.name)
    except UserError as err:  # its message begins "env.name = ...: "
        bad("env.name", e.name, str(err).split(": ", 1)[-1])
    else:  # one instance now, so a wrong env.kwargs stops the run here rather than failing every trajectory
        try:
            cls(**e.kwargs)
        except Exception as err:
            bad("env.kwargs", dict(e.kwargs), f"{e.name} cannot be built with them: {type(err).__name__}: {err}")
    for key in ("max_turns", "timeout_s", "num_workers"):
        positive(f"env.{key}", getattr(e, key))
    choice("env.observation_role", e.observation_role, ("user", "tool"))
    if cfg.reward.model_path is not None:
        bad("reward.model_path", cfg.reward.model_path, "with env.name the environment gives the rewards; unset one")


def validate_agent(cfg: RunConfig, bad, positive) -> None:
    """agent.fn: the user's agent through the rollout's endpoint (rollout.agent, docs/agents.md)."""
    g = cfg.agent
    if g.fn is None:
        return
    from rollout.agent import load_agent
    try:
        load_agent(g.fn)
    except UserError as err:  # its message begins "agent.fn = ...: "
        bad("agent.fn", g.fn, str(err).split(": ", 1)[-1])
    for key in ("max_calls", "timeout_s", "concurrency"):
        positive(f"agent.{key}", getattr(g, key))
    from vllm.tool_parsers import ToolParserManager
    if g.tool_parser not in ToolParserManager.list_registered():
        bad("agent.tool_parser", g.tool_parser, "must be one of vLLM's tool-call parsers: "
            + ", ".join(ToolParserManager.list_registered()))
    if cfg.env.name is not None:
        bad("agent.fn", g.fn, "an agent and an environment (env.name) both play the episodes: set one")
    for key in ("fn", "model_path", "url"):
        if getattr(cfg.reward, key) is not None:
            bad(f"reward.{key}", getattr(cfg.reward, key), "with agent.fn the agent returns each episode's reward; "
                "unset it")


def validate_async(cfg: RunConfig, bad, positive) -> None:
    """rollout.max_staleness > 0: what can run ahead of the trainer (docs/async.md)."""
    r = cfg.rollout
    positive("rollout.chunk_tokens", r.chunk_tokens)
    if r.inflight_kv not in ("keep", "recompute"):
        bad("rollout.inflight_kv", r.inflight_kv, "must be keep (kept samples continue on their KV so far after a "
            "sync) or recompute (their context is prefilled again under the new weights)")
    if r.max_staleness < 0:
        bad("rollout.max_staleness", r.max_staleness, "must be >= 0 (0 = synchronous; K = samples at most K updates "
            "behind the trained weights)")
    if r.max_staleness == 0:
        return
    if cfg.placement.num_gpus > 0 and cfg.placement.mode == "colocate":
        bad("rollout.max_staleness", r.max_staleness, "colocated roles take turns on the GPUs (the engines sleep "
            "while the trainers train), so nothing can run ahead: use placement.mode=split, or max_staleness=0")


def validate_sync(cfg: RunConfig, bad) -> None:
    """The weight-sync channel against the placement (what NCCL and CUDA IPC can and cannot do)."""
    r = cfg.rollout
    pl = cfg.placement
    if pl.mode == "hybrid":
        validate_hybrid(cfg, bad)
        return
    from rollout.sync import cuda_ipc_reaches
    if r.sync_channel == "ipc" and pl.num_gpus > 0 and not cuda_ipc_reaches(pl.mode, r.num_engines,
                                                                            cfg.trainer.world_size):
        bad("rollout.sync_channel", r.sync_channel, "CUDA IPC needs every engine on a trainer rank's GPU: use "
            "placement.mode=colocate with rollout.num_engines <= trainer.world_size, or sync_channel=broadcast")
    full_sync = not (cfg.model.lora.rank > 0 and r.engine == "vllm" and r.lora_sync == "adapter")
    gpu_colocated = pl.num_gpus > 0 and pl.mode == "colocate"
    if full_sync and gpu_colocated and (r.sync_channel == "broadcast" or (
            r.sync_channel == "auto" and not cuda_ipc_reaches(pl.mode, r.num_engines, cfg.trainer.world_size))):
        bad("rollout.sync_channel", r.sync_channel, "would broadcast over NCCL, which refuses two ranks on one GPU "
            "(colocated, engine 0 shares GPU 0 with trainer rank 0): use sync_channel=auto/ipc with "
            f"rollout.num_engines <= trainer.world_size = {cfg.trainer.world_size} (CUDA IPC), or "
            "placement.mode=split")
    if cfg.model.lora.rank > 512 and r.engine == "vllm" and r.lora_sync == "adapter":
        bad("model.lora.rank", cfg.model.lora.rank, "vLLM applies adapters up to rank 512; lower it or set "
            "rollout.lora_sync=merged")


def validate_hybrid(cfg: RunConfig, bad) -> None:
    """`placement.mode: hybrid`: one engine inside each trainer rank, its engine core in the same process, synced
    by reference; the rank does one thing at a time."""
    r, world = cfg.rollout, cfg.trainer.world_size
    if r.num_engines != world:
        bad("rollout.num_engines", r.num_engines, f"placement.mode=hybrid puts one engine in each trainer rank: set "
            f"rollout.num_engines={world} (trainer.world_size), or placement.mode=colocate")
    if r.sync_channel != "auto":
        bad("rollout.sync_channel", r.sync_channel, "placement.mode=hybrid hands the weights to the engine in the "
            "same process: set rollout.sync_channel=auto, or placement.mode=colocate")
    if r.multiprocess:
        bad("rollout.multiprocess", True, "placement.mode=hybrid keeps the engine core in the trainer's process "
            "(the sync passes tensors by reference): set rollout.multiprocess=null, or placement.mode=colocate")
    if r.max_staleness > 0:
        bad("rollout.max_staleness", r.max_staleness, "placement.mode=hybrid generates and trains in one process, one "
            "after the other, so nothing can run ahead: set rollout.max_staleness=0, or placement.mode=colocate/split")
