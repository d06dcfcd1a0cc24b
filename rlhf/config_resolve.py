"""The run as it will run: every key whose null default depends on the machine or on other keys, filled in once,
after validation (`rlhf.run`), so `--print-config` and the run's saved `config.yaml` show what ran, not `null`.
The rules themselves stay where they are used (rlhf.placement, rlhf.startup, rlhf.config)."""
from __future__ import annotations

from dataclasses import replace

from common.options import precision_of
from rlhf.config import RunConfig, logprob_diff_warn


ASYNC_TIS_CAP = 2.0  # rollout.max_staleness > 0: algorithm.tis_cap unless set
ASYNC_TIS_MASK = (0.5, 5.0)  # and tis_mask_low / tis_mask_high (IcePop's bounds)


def resolved(cfg: RunConfig) -> RunConfig:
    from algorithms.estimators import estimator
    from rlhf.placement import cpu_threads, multiprocess_engine, reference_ranks, seed_per_prompt
    from rlhf.startup import busy_at_once, role_ranks

    r, pl, a = cfg.rollout, cfg.placement, cfg.algorithm
    hybrid = pl.mode == "hybrid"  # the engine core stays in the rank's process
    rollout = replace(r, logprob_diff_warn=logprob_diff_warn(cfg),
                      seed_per_prompt=seed_per_prompt(r.seed_per_prompt, pl.num_gpus),
                      multiprocess=False if hybrid else multiprocess_engine(r.multiprocess, pl.num_gpus),
                      gpu_memory_utilization=r.gpu_memory_utilization or (0.9 if pl.mode == "split" else 0.5))
    algorithm = replace(a, loss_norm_len=a.loss_norm_len or r.max_new_tokens)
    if r.max_staleness > 0:  # samples of older weights: the off-policy correction is on unless set
        algorithm = replace(algorithm, tis_cap=a.tis_cap or ASYNC_TIS_CAP,
                            tis_mask_low=a.tis_mask_low or ASYNC_TIS_MASK[0],
                            tis_mask_high=a.tis_mask_high or ASYNC_TIS_MASK[1])
    placement = replace(pl, reference_ranks=reference_ranks(pl.reference_ranks, pl.mode, pl.num_gpus,
                                                            cfg.trainer.world_size))
    trainer = replace(cfg.trainer, precision=precision_of(cfg.trainer.precision, cfg.model.dtype))
    out = replace(cfg, rollout=rollout, algorithm=algorithm, placement=placement, trainer=trainer)
    ranks = role_ranks(out, cfg.stage == "rl" and estimator(a.name).needs_critic) if cfg.stage == "rl" else {
        "policy": 1}
    threads = cpu_threads(pl.cpu_threads, busy_at_once(out, ranks))
    return replace(out, placement=replace(placement, cpu_threads=threads))
