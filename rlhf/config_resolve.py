"""The run as it will run: every key whose null default depends on the machine or on other keys, filled in once,
after validation (`rlhf.run`), so `--print-config` and the run's saved `config.yaml` show what ran, not `null`.
The rules themselves stay where they are used (rlhf.placement, rlhf.startup, rlhf.config)."""
from __future__ import annotations

from dataclasses import replace

from rlhf.config import RunConfig, logprob_diff_warn


def resolved(cfg: RunConfig) -> RunConfig:
    from algorithms.estimators import estimator
    from rlhf.placement import cpu_threads, multiprocess_engine, reference_ranks, seed_per_prompt
    from rlhf.startup import busy_at_once, role_ranks

    r, pl, a = cfg.rollout, cfg.placement, cfg.algorithm
    hybrid = pl.mode == "hybrid"  # the engine core stays in the rank's process
    rollout = replace(r, logprob_diff_warn=logprob_diff_warn(cfg),
                      seed_per_prompt=seed_per_prompt(r.seed_per_prompt, pl.num_gpus),
                      multiprocess=False if hybrid else multiprocess_engine(r.multiprocess, pl.num_gpus))
    algorithm = replace(a, loss_norm_len=a.loss_norm_len or r.max_new_tokens)
    placement = replace(pl, reference_ranks=reference_ranks(pl.reference_ranks, pl.mode, pl.num_gpus,
                                                            cfg.trainer.world_size))
    out = replace(cfg, rollout=rollout, algorithm=algorithm, placement=placement)
    ranks = role_ranks(out, cfg.stage == "rl" and estimator(a.name).needs_critic) if cfg.stage == "rl" else {
        "policy": 1}
    threads = cpu_threads(pl.cpu_threads, busy_at_once(out, ranks))
    return replace(out, placement=replace(placement, cpu_threads=threads))
